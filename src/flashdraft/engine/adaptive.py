"""Adaptive drafting: draft the full block while the drafter's acceptance pays for what a drafting step costs,
decode plainly while it does not, and probe back with backoff.

Decisions come from acceptance statistics and a cost model fixed when the controller is made (DraftCost,
estimated once from the models' weights and the device by estimate_cost), never from step timings: the
controller reads no clock and uses no randomness, so the same (drafted, accepted) history gives the same
decisions. Greedy runs are therefore reproducible in their draft lengths and tau on a busy machine too.

- Acceptance: E(n), the tokens a step drafting n guesses commits (min(correct guesses, n) + 1), as an EWMA over
  the drafting steps; one full-block step tells it for every n at once.
- Cost: a step drafting n guesses costs R(n) = 1 + fixed + per_token * n plain steps.
- Gain G(n) = E(n) / R(n): throughput relative to plain decoding. Drafting stays on while G(full block) >= 1
  (losing steps are summed, so one unlucky step does not switch it off), and a probe switches it back on when
  G >= 1 + profit_min.

Only the full block (or what is left of the request) is drafted: DFlash drafts the whole block in one pass,
so a long draft costs hardly more than a short one, and docs/adaptive.md found that searching the length did
not pay where switching drafting on and off did. docs/adaptive.md describes the algorithm and its evidence.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass

log = logging.getLogger("flashdraft.adaptive")

ON, OFF = "on", "off"
# Kinds of the steps handed out: a drafting step while on, a plain step while off, a probe while off.
DRAFT, PLAIN, PROBE = "draft", "plain", "probe"


@dataclass(frozen=True)
class AdaptiveConfig:
    alpha: float = 0.15           # EWMA weight of a drafting step's tokens (the first 1/alpha steps are averaged)
    min_samples: int = 3          # drafting steps before the first decision; steps of a probe
    profit_min: float = 0.05      # a probe switches drafting on at a gain of 1 + profit_min, and ends early
                                  # below 1 - profit_min (the band between is hysteresis)
    off_shortfall: float = 1.0    # switch off once consecutive losing steps fell short of plain decoding by this
                                  # many plain steps in all (estimated): a clear loss stops within a few steps
    probe_interval: int = 4      # plain steps before the first probe once off
    max_backoff: int = 5          # the wait doubles per failed probe, at most this many times

    def validate(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"adaptive alpha must be in (0, 1], got {self.alpha}")
        if not 0 <= self.profit_min < 1:
            raise ValueError(f"adaptive profit_min must be in [0, 1), got {self.profit_min}")
        if not 0 < self.off_shortfall <= 100:
            raise ValueError(f"adaptive off_shortfall must be in (0, 100], got {self.off_shortfall}")
        for name in ("min_samples", "probe_interval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"adaptive {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_backoff, int) or not 0 <= self.max_backoff <= 16:
            raise ValueError(f"adaptive max_backoff must be an integer in [0, 16], got {self.max_backoff!r}")


@dataclass(frozen=True)
class DraftCost:
    """What a step drafting n guesses costs, in plain decoding steps: 1 + fixed + per_token * n (n > 0).
    The default is a middle guess for a pair whose cost was not estimated (see estimate_cost)."""

    fixed: float = 1.0
    per_token: float = 0.02

    def __post_init__(self):
        for name in ("fixed", "per_token"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1e6):
                raise ValueError(f"draft cost {name} must be a number >= 0, got {value!r}")

    def ratio(self, n: int) -> float:
        return 1.0 + self.fixed + self.per_token * n if n > 0 else 1.0


class Ewma:
    """Exponentially weighted mean whose first samples are averaged (weight max(alpha, 1/count))."""

    __slots__ = ("alpha", "value", "count")

    def __init__(self, alpha: float):
        self.alpha, self.value, self.count = alpha, 0.0, 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += max(self.alpha, 1.0 / self.count) * (x - self.value)


class AdaptiveDraft:
    """A DraftPolicy (next_length / record) that drafts the full block or nothing; one per slot, it keeps learning
    across requests. state() is its JSON-able summary for /props and /metrics."""

    def __init__(self, max_draft: int, config: AdaptiveConfig | None = None, cost: DraftCost | None = None):
        if not isinstance(max_draft, int) or max_draft < 0:
            raise ValueError(f"max_draft must be an integer >= 0, got {max_draft!r}")
        self.config = config or AdaptiveConfig()
        self.config.validate()
        self.cost = cost or DraftCost()
        self.base = max_draft
        # tokens[n]: what a step drafting n guesses commits, min(run of correct guesses, n) + 1, averaged over the
        # drafting steps (index 0 unused). Greedy guesses do not depend on the length drafted, so a step of length
        # d tells it exactly for every n <= d: a full-block step updates every length alike.
        self.tokens = [Ewma(self.config.alpha) for _ in range(max_draft + 1)]
        self.mode = ON if max_draft > 0 else OFF
        self.steps = 0
        self.switches = 0
        self.shortfall = 0.0         # summed 1 - gain over the current run of losing drafting steps
        self.off_steps = 0           # plain steps since switching off or since the last probe
        self.probe_failures = 0      # failed probes since drafting was last on (sets the backoff)
        self.probing = False         # a probe is due or under way
        self.probe_done = 0          # steps of the probe under way
        # Kinds of the steps handed out and not yet recorded, oldest first: with pipelined steps the next step's
        # length is chosen before this one's result is recorded.
        self._planned: deque[str] = deque()

    @classmethod
    def for_engine(cls, engine, config: AdaptiveConfig | None = None) -> "AdaptiveDraft":
        """A controller priced for an engine's target and drafter on its device (estimate_cost)."""
        d = engine.decoder
        cost = estimate_cost(d.target, d.drafter, d.device.type) if d.drafter is not None else None
        return cls(engine.max_draft, config, cost)

    @property
    def length(self) -> int:
        """The length drafted on ordinary steps: the full block while on, 0 while off."""
        return self.base if self.mode == ON else 0

    # --- DraftPolicy -------------------------------------------------------------------------------------------

    def next_length(self, max_useful: int) -> int:
        if self.mode == ON:
            n = max(0, min(self.base, max_useful))
            # Fewer guesses than the block (a request's last tokens, a request's n_max) may not pay for the
            # drafter pass, which costs the same: decode plainly then.
            if 0 < n < self.base and self._ready() and self.gain(n) < 1.0:
                n = 0
            self._planned.append(DRAFT)
            return n
        if self.base > 0 and (self.probing or self.off_steps >= self._probe_wait()):
            self.probing = True
            self._planned.append(PROBE)
            return max(0, min(self.base, max_useful))
        self._planned.append(PLAIN)
        return 0

    def unplan(self, count: int) -> None:
        """Forget the last `count` lengths handed out: their steps were dropped unrecorded (queued past a
        request's end)."""
        for _ in range(min(count, len(self._planned))):
            self._planned.pop()

    def record(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """Learn from a step. `seconds` is accepted for the DraftPolicy protocol and not read: decisions never
        depend on timing."""
        if not isinstance(drafted, int) or not 0 <= drafted <= self.base:
            raise ValueError(f"drafted must be an integer in [0, {self.base}], got {drafted!r}")
        if not isinstance(accepted, int) or not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be an integer in [0, drafted={drafted}], got {accepted!r}")
        self.steps += 1
        kind = self._planned.popleft() if self._planned else None
        probe = kind == PROBE and self.mode == OFF and self.probing and drafted > 0
        if probe and self.probe_done == 0:
            # What was learnt before switching off is stale by now (the text has moved on, and it was what
            # switched drafting off): the probe starts the acceptance statistics afresh.
            for t in self.tokens:
                t.count = 0
        for n in range(1, drafted + 1):
            self.tokens[n].add(min(accepted, n) + 1.0)
        if kind == PLAIN and self.mode == OFF:
            self.off_steps += 1
        elif kind == DRAFT and self.mode == ON and drafted > 0:
            self._decide(drafted)
        elif probe:
            self._probe(accepted)
        # Anything else (a step the policy did not choose, or one planned before the last switch) only teaches.

    # --- estimates ---------------------------------------------------------------------------------------------

    def _ready(self) -> bool:
        return self.base > 0 and self.tokens[1].count > 0

    def expected_tokens(self, n: int) -> float:
        """E(n): tokens a step drafting n guesses is expected to commit. A length longer than any drafted since the
        statistics started is priced as the longest one drafted (what it commits at least)."""
        n = min(n, self.base)
        while n > 0 and self.tokens[n].count == 0:
            n -= 1
        return self.tokens[n].value if n > 0 else 1.0

    def gain(self, n: int | None = None) -> float:
        """E(n) / R(n): throughput of drafting n guesses (default the full block) relative to plain decoding."""
        n = self.base if n is None else n
        return self.expected_tokens(n) / self.cost.ratio(n)

    # --- decisions ---------------------------------------------------------------------------------------------

    def _probe_wait(self) -> int:
        return self.config.probe_interval * 2 ** min(self.probe_failures, self.config.max_backoff)

    def _decide(self, drafted: int) -> None:
        """After a drafting step: switch off once the losing steps' summed shortfall (1 - gain each, at the length
        drafted: the full block but where a request capped it) reaches off_shortfall. A clear loss ends drafting
        within a few steps, a marginal one only after many, so acceptance noise rarely switches it off; a winning
        step clears the sum."""
        if self.tokens[1].count < self.config.min_samples:
            return  # the first drafting steps only learn: one unlucky step must not switch drafting off
        g = self.gain(drafted)
        if g >= 1.0:
            self.shortfall = 0.0
            return
        self.shortfall += 1.0 - g
        if self.shortfall >= self.config.off_shortfall:
            self._switch(OFF, drafted)
            self.off_steps = 0
            self.shortfall = 0.0

    def _probe(self, accepted: int) -> None:
        """A probe drafts the full block for min_samples steps, and drafting comes back on when the gain then
        reaches 1 + profit_min. A step that accepted nothing ends the probe at once while the gain is below
        1 - profit_min, so where drafting clearly loses a probe mostly costs one step. The wait before the next
        probe doubles after a failed one, unless the gain reached 1 (close: retry soon)."""
        cfg = self.config
        self.probe_done += 1
        g = self.gain()
        if self.probe_done >= cfg.min_samples and g >= 1.0 + cfg.profit_min:
            self.probe_failures = 0
            self._end_probe()
            self._switch(ON, self.base)
        elif self.probe_done >= cfg.min_samples or (accepted == 0 and g < 1.0 - cfg.profit_min):
            self.probe_failures = 0 if g >= 1.0 else self.probe_failures + 1
            self._end_probe()

    def _end_probe(self) -> None:
        self.probing = False
        self.probe_done = self.off_steps = 0
        self.shortfall = 0.0

    def _switch(self, mode: str, length: int) -> None:
        """Switch drafting on or off; one log line with the estimates at the length that decided it."""
        self.mode = mode
        self.switches += 1
        log.info("adaptive drafting %s (expected %.2f tokens per step at length %d, step cost %.2f plain steps: "
                 "gain %.2f)", mode, self.expected_tokens(length), length, self.cost.ratio(length), self.gain(length))

    # --- reporting ---------------------------------------------------------------------------------------------

    def state(self) -> dict:
        """JSON-able summary: mode, length, the estimates behind the decision, the cost model, counters."""
        ready = self._ready()
        return {
            "mode": self.mode,
            "probing": self.probing,
            "length": self.length,
            "max_length": self.base,
            "expected_tokens": self.expected_tokens(self.base) if ready else None,
            "step_cost": self.cost.ratio(self.base),
            "gain": self.gain() if ready else None,
            "cost": asdict(self.cost),
            "switches": self.switches,
            "steps": self.steps,
            "shortfall": self.shortfall,
            "probe_failures": self.probe_failures,
            "config": asdict(self.config),
        }


# --- the cost model -----------------------------------------------------------------------------------------------
# A decoding step is dominated by reading the weights (GPU, and a CPU's one-row matrix-vector products) or by the
# arithmetic on them (a CPU's multi-row products). Per weight byte, a pass of T rows costs rows_factor(T) times a
# one-row pass: on CUDA the passes of up to a block are memory-bound (1 + 0.004 per extra row: the synthetic
# Qwen3-8B pair's measured step cost, docs/performance.md), on a CPU a multi-row product costs 1.5x + 0.034x per
# row more (the demo pair on the 2-core development machine: a 2-row target pass 1.57x a 1-row one, 16 rows
# 2.0-2.2x).

def rows_factor(rows: int, device_type: str) -> float:
    if device_type == "cpu":
        return 1.0 if rows <= 1 else 1.5 + 0.034 * rows
    return 1.0 + 0.004 * (rows - 1)


def weight_bytes(model) -> tuple[float, float, float]:
    """(lm_head bytes, expert bytes, other weight bytes) of a model: the matrices (2-D or more) its passes read,
    each storage once (fused projections are views). Embedding tables are left out unless the LM head shares
    them (a lookup reads a row), rotary tables too."""
    lm_head = getattr(model, "lm_head", None)
    embedded, counted = set(), set()
    for m in model.modules():
        if "Embedding" in type(m).__name__:
            embedded |= {_storage(t) for t in _own_tensors(m)}
    lm = experts = other = 0.0
    for m in model.modules():
        kind = type(m).__name__
        if "Embedding" in kind or "Rotary" in kind:
            continue
        for t in _own_tensors(m):
            key = _storage(t)
            if key in counted or t.dim() < 2:
                continue
            counted.add(key)
            size = t.untyped_storage().nbytes()
            if m is lm_head:
                lm += size
            elif kind.endswith("Experts"):
                experts += size
            else:
                other += size
    return lm, experts, other


def _own_tensors(module):
    yield from module.parameters(recurse=False)
    yield from (b for b in module.buffers(recurse=False) if b is not None)


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


def estimate_cost(target, drafter, device_type: str) -> DraftCost:
    """The cost of drafting steps relative to a plain step, from the weights each pass reads (once, at
    load: no timing). A drafting step of n guesses runs the drafter over its block, the target's LM head over the
    n drafted rows, and the target over n + 1 rows; a plain step runs the target over one row. A mixture of
    experts reads about rows * top_k / num_experts of its experts in a pass (all of them at most). Fitted to
    1 + fixed + per_token * n through n = 1 and n = block - 1."""
    lm, experts, other = weight_bytes(target)
    _, d_experts, d_other = weight_bytes(drafter)
    cfg = target.config
    n_experts, top_k = getattr(cfg, "num_experts", 0) or 0, getattr(cfg, "top_k_experts", 0) or 0
    block = drafter.block_size

    def target_pass(rows: int) -> float:
        share = min(1.0, rows * top_k / n_experts) if n_experts and top_k else 1.0
        return rows_factor(rows, device_type) * (lm + other + experts * share)

    def drafting(n: int) -> float:
        return (target_pass(n + 1) + rows_factor(block, device_type) * (d_other + d_experts)
                + rows_factor(n, device_type) * lm)

    plain = target_pass(1)
    if plain <= 0:
        return DraftCost()
    last = max(block - 1, 1)
    r1, rn = drafting(1) / plain, drafting(last) / plain
    per_token = max(0.0, (rn - r1) / (last - 1)) if last > 1 else 0.0
    return DraftCost(fixed=max(0.0, r1 - 1.0 - per_token), per_token=per_token)
