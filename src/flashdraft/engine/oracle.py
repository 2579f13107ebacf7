"""Oracle proposals: the target's own continuation with a planted mismatch, for benchmarks at a chosen tau."""
from __future__ import annotations

import torch


class PlantedOracle:
    """Replaces the drafter's guesses at step s by reference[start+1 : start+1+n] with the guess at index
    accept_pattern(s) changed to a wrong token, so that exactly that many guesses are accepted (all of them
    when the pattern says n or more). `reference` must be the sequence the target itself produces (the
    baseline's tokens, prompt included); the drafter still runs, so its cost is real."""

    def __init__(self, reference: list[int], accept_pattern, vocab_size: int, device):
        self.reference = torch.tensor(reference + [0] * 128, device=device)
        self.pattern = accept_pattern
        self.vocab_size = vocab_size
        self.calls = 0

    def __call__(self, start: int, guesses: torch.Tensor) -> torch.Tensor:
        n = guesses.shape[0]
        proposals = self.reference[start + 1:start + 1 + n].clone()
        k = int(self.pattern(self.calls))
        self.calls += 1
        if k < n:
            proposals[k] = (proposals[k] + 1) % self.vocab_size
        return proposals
