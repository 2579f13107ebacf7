"""Oracle proposals: the target's own continuation with a planted mismatch, for benchmarks at a chosen tau."""
from __future__ import annotations

import torch

PATTERN_STEPS = 4096  # steps of the acceptance pattern kept on the device (it repeats after that)


class PlantedOracle:
    """Replaces the drafter's guesses at step s by reference[start+1 : start+1+n] with the guess at index
    accept_pattern(s) changed to a wrong token, so that exactly that many guesses are accepted (all of them
    when the pattern says n or more). `reference` must be the sequence the target itself produces (the
    baseline's tokens, prompt included); the drafter still runs, so its cost is real. It replaces the guesses of
    the sequence made with it: engine.generate(prompt, params, draft, sequence=engine.new_sequence(oracle=...)).

    Everything it reads lives on the device, its step counter included, and start may be a device scalar, so a
    call can be captured in a pipelined step's CUDA graph (engine.speculative) and replayed step after step."""

    def __init__(self, reference: list[int], accept_pattern, vocab_size: int, device):
        self.reference = torch.tensor(reference + [0] * 128, device=device)
        self.planted = torch.tensor([int(accept_pattern(s)) for s in range(PATTERN_STEPS)], device=device)
        self.vocab_size = vocab_size
        self.calls = torch.zeros(1, dtype=torch.long, device=device)
        self.mutable = [self.calls]  # what a step changes (engine.speculative's Oracle)

    def reset(self) -> None:
        """Start the pattern again from step 0."""
        self.calls.zero_()

    def replan(self, accept_pattern) -> None:
        """A new acceptance pattern, written over the old one in place (graphs that captured this oracle replay
        the new one), from step 0."""
        self.planted.copy_(torch.tensor([int(accept_pattern(s)) for s in range(PATTERN_STEPS)]))
        self.reset()

    def __call__(self, start: int | torch.Tensor, guesses: torch.Tensor) -> torch.Tensor:
        n = guesses.shape[0]
        slots = torch.arange(n, device=self.reference.device)
        proposals = self.reference[start + 1 + slots]
        wrong = slots == self.planted[self.calls % PATTERN_STEPS]
        self.calls += 1
        return torch.where(wrong, (proposals + 1) % self.vocab_size, proposals)
