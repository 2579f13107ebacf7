"""Prompt-lookup proposals: the continuation of the most recent earlier occurrence of the longest suffix, an index
that follows a growing sequence, and one that starts over on a new one."""
import random

import pytest

from flashdraft.engine.ngram import NgramProposer


def brute_force(tokens, k, min_n, max_n):
    """The definition, written out: longest suffix first, most recent earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_continues_the_most_recent_earlier_occurrence():
    p = NgramProposer(min_n=2, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # suffix [6, 7] (no earlier [9, 6, 7] or [2, 6, 7]): most recent earlier occurrence ends at 7 -> [9, 2, 6]
    assert p.propose(tokens, 3) == [9, 2, 6]
    assert p.propose(tokens + [9], 4) == [2, 6, 7, 9]  # [6, 7, 9] occurred, ending at 8


def test_longer_suffix_wins_over_a_more_recent_shorter_one():
    p = NgramProposer(min_n=1, max_n=3)
    tokens = [1, 2, 3, 40, 9, 3, 50, 1, 2, 3]
    assert p.propose(tokens, 2) == [40, 9]  # [1, 2, 3] beats the more recent [3] (-> 50)


def test_nothing_when_the_ending_never_occurred():
    p = NgramProposer(min_n=2, max_n=4)
    assert p.propose([1, 2, 3, 4, 5], 4) == []
    assert p.propose([1], 4) == [] and p.propose([1, 2, 3], 0) == []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 4), (3, 5)])
def test_matches_the_definition_as_the_sequence_grows_and_changes(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    p = NgramProposer(min_n, max_n)
    for _ in range(3):  # three different sequences through one proposer
        tokens = [rng.randrange(6) for _ in range(3)]
        for _ in range(150):
            k = rng.randrange(1, 9)
            assert p.propose(tokens, k) == brute_force(tokens, k, min_n, max_n), tokens
            tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_a_shorter_or_different_sequence_is_indexed_afresh():
    p = NgramProposer(min_n=2, max_n=2)
    assert p.propose([1, 2, 7, 1, 2], 1) == [7]
    assert p.propose([1, 2, 8, 1, 2], 1) == [8]   # same length, another sequence
    assert p.propose([3, 1, 2], 1) == []          # shorter: nothing of the old one is left
    assert p.propose([3, 1, 2, 9, 1, 2], 1) == [9]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)
