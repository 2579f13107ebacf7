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


# --- n-gram drafting in the engine ------------------------------------------------------------------------------

from flashdraft.config import Constraint, SamplingParams  # noqa: E402
from flashdraft.demo import DEMO_DIR  # noqa: E402
from flashdraft.engine.generator import Engine  # noqa: E402
from flashdraft.engine.ngram import NgramSettings  # noqa: E402


@pytest.fixture(scope="module")
def demo_ngram():
    return Engine.load(DEMO_DIR / "target", None, device="cpu", ngram=NgramSettings())


@pytest.fixture(scope="module")
def demo_plain():
    return Engine.load(DEMO_DIR / "target", None, device="cpu")


def code_prompt(engine):
    return engine.encode_prompt(messages=[{"role": "user", "content": "Write a Python class Stack with push, pop, "
                                                                     "peek and is_empty, and tests for each."}])


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=120, ignore_eos=True),
    SamplingParams(max_tokens=120, temperature=0.7, top_k=64, top_p=0.95, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=60, presence_penalty=0.5, logprobs=2),
], ids=["greedy", "sampled", "penalty-logprobs"])
def test_ngram_drafting_is_lossless_on_the_demo_target(demo_ngram, demo_plain, params):
    prompt = code_prompt(demo_plain)
    plain = demo_plain.generate(prompt, params)
    ngram = demo_ngram.generate(prompt, params)
    assert ngram.tokens == plain.tokens
    assert ngram.stats.draft_n > 0 and ngram.stats.draft_n_accepted > 0  # the lookup found repeats and they held
    assert ngram.stats.steps < len(ngram.tokens)
    if params.logprobs is not None:
        # a verify pass's rows may round apart from one-row passes in the last bits (CPU GEMMs pick kernels by
        # shape): the same tokens, log-probabilities equal to 1e-4
        assert [p.token for p in ngram.logprobs] == [p.token for p in plain.logprobs]
        assert [p.logprob for p in ngram.logprobs] == pytest.approx([p.logprob for p in plain.logprobs], abs=1e-4)


def test_ngram_drafting_under_a_grammar(demo_ngram, demo_plain):
    params = SamplingParams(max_tokens=80, constraint=Constraint("json_object"))
    prompt = code_prompt(demo_plain)
    assert demo_ngram.generate(prompt, params).tokens == demo_plain.generate(prompt, params).tokens


def test_ngram_drafting_on_a_tiny_model_with_random_prompts(qwen3_dir):
    rng = random.Random(1)
    plain = Engine.load(qwen3_dir, None, device="cpu", context_size=256)
    ngram = Engine.load(qwen3_dir, None, device="cpu", context_size=256, ngram=NgramSettings(1, 2, 5))
    assert ngram.max_draft == 5 and plain.max_draft == 0
    vocab = plain.decoder.target.config.vocab_size
    for _ in range(4):
        motif = [rng.randrange(vocab) for _ in range(6)]
        prompt = motif * 4 + [rng.randrange(vocab) for _ in range(3)]  # repeats for the lookup to find
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        assert ngram.generate(prompt, params).tokens == plain.generate(prompt, params).tokens


def test_ngram_beside_a_drafter_stands_in_where_the_text_repeats(qwen3_dir, drafter_dir):
    """--spec-type dflash+ngram: the lookup's proposal stands in for the drafter's block where it is long or the
    draft policy has the drafter off; greedy and sampled output stay the target's; a request with drafting off
    (draft 0) looks nothing up; looked-up steps teach the draft policy nothing."""
    from flashdraft.engine.generator import FixedDraft
    from flashdraft.engine.speculative import LONG_LOOKUP

    rng = random.Random(2)
    plain = Engine.load(qwen3_dir, None, device="cpu", context_size=256)
    both = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256, ngram=NgramSettings())
    assert both.max_draft == both.decoder.drafter.block_size - 1 >= LONG_LOOKUP - 1
    vocab = plain.decoder.target.config.vocab_size
    seen = []
    real_launch = both.decoder.launch

    def launch(seq, n, lookup_max=0, **options):
        launched = real_launch(seq, n, lookup_max, **options)
        seen.append((n, launched.done.looked_up if launched.done is not None else False, launched.drafted))
        return launched

    both.decoder.launch = launch
    recorded = []

    class Recording(FixedDraft):
        def record(self, drafted, accepted, seconds):
            recorded.append(drafted)

    for _ in range(3):
        motif = [rng.randrange(vocab) for _ in range(12)]
        prompt = motif * 4 + [rng.randrange(vocab) for _ in range(2)]
        for params in (SamplingParams(max_tokens=40, ignore_eos=True),
                       SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)):
            want = plain.generate(prompt, params).tokens
            assert both.generate(prompt, params, draft=Recording(0)).tokens == want  # drafter off: lookups only
            assert both.generate(prompt, params, draft=both.max_draft).tokens == want
            seen.clear()
            assert both.generate(prompt, params, draft=0).tokens == want
            assert not any(looked for _, looked, _ in seen)  # drafting off for the request: no lookup either
    assert recorded and set(recorded) == {0}  # looked-up steps recorded as plain ones
    # the rule: a long proposal stands in for the drafter's block, a short one only where the drafter is off
    motif = rng.sample(range(vocab), 20)

    def lookup(tokens, n, lookup_max):
        seq = both.new_sequence()  # a proposer's index follows one sequence's tokens as they grow
        seq.tokens = tokens
        return both.decoder._lookup(seq, n, lookup_max)

    assert lookup(motif * 2 + motif[:3], both.max_draft, both.max_draft) == motif[3:3 + both.max_draft]
    assert lookup(motif * 2 + motif[:3], both.max_draft, 0) is None  # drafting off for the request
    assert lookup(motif[:5] + motif[:1], 0, both.max_draft) == motif[1:5] + motif[:1]  # short: the drafter off
    assert lookup(motif[:5] + motif[:1], both.max_draft, both.max_draft) is None  # the drafter's block instead
    with pytest.raises(ValueError, match="max_draft"):
        NgramSettings(max_draft=0)
