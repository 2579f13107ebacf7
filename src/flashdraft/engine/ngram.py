"""Prompt-lookup drafting: propose the tokens that followed the last earlier occurrence of the text's ending.

Outputs that copy their input (code edits, answers quoting a file, agents repeating tool output) continue a
stretch seen before: find the longest suffix of the sequence, from `max_n` tokens down to `min_n`, that occurred
earlier, and guess the tokens that came after its most recent occurrence. It needs no model, so it drafts where
no drafter exists; verification is the same as for a drafter's block, so the output stays the target's.

The index maps each n-gram to where its most recent occurrence ended, and grows with the sequence: a proposal
costs O(max_n) dictionary lookups, however long the context.
"""
from __future__ import annotations

from dataclasses import dataclass


def check_sizes(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}")


@dataclass(frozen=True)
class NgramSettings:
    """n-gram drafting: suffixes of min_n to max_n tokens are looked up, and up to max_draft tokens proposed."""

    min_n: int = 1
    max_n: int = 3
    max_draft: int = 8

    def __post_init__(self):
        check_sizes(self.min_n, self.max_n)
        if self.max_draft < 1:
            raise ValueError(f"n-gram drafting needs max_draft >= 1, got {self.max_draft}")

    def proposer(self) -> "NgramProposer":
        return NgramProposer(self.min_n, self.max_n)


class NgramProposer:
    """Proposals for one sequence. `propose` indexes the sequence as it grows; a sequence that is not the one
    indexed grown (its length, first or last indexed token differ) is indexed afresh. A change that check misses
    can only make guesses worse, never the output: every guess is verified."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        check_sizes(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self._indexed = 0  # length of the sequence last seen: every n-gram ending before its end is indexed
        self._marks: tuple[int, int] = (-1, -1)  # that sequence's first and last token
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its most recent occurrence

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k guesses for the tokens after `tokens`; empty when its ending occurred nowhere before."""
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        self._follow(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end:end + k]
        return []

    def _follow(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the last token (the one ending there is the suffix looked up)."""
        done = self._indexed
        if done and (len(tokens) < done or (tokens[0], tokens[done - 1]) != self._marks):
            self._ends, done = {}, 0
        for end in range(max(done, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n:end])] = end
        self._indexed, self._marks = len(tokens), (tokens[0], tokens[-1])
