"""Adaptive draft length, after BeeLlama's 'profit' controller: draft the length (0 = plain decoding included)
that gives the most tokens per second, learned from what each step accepted and how long it took.

Per draft position p the controller keeps an EWMA of "guess p was accepted, given that the guesses before it
were"; their running product is the survival of position p (the chance a step commits guess p). Per draft length
it keeps an EWMA of the step time. A step drafting n guesses is expected to commit E(n) = 1 + sum_{p<n}
survival[p] tokens, so score(n) = E(n) / step_time(n) tokens/s; length 0 (plain decoding) scores
1 / step_time(0), the baseline. Lengths whose step time was not measured borrow a linear cost model fitted to
the measured lengths. It is a pure function of the (drafted, accepted, seconds) triples it is fed: no clock, no
randomness, so simulations replay exactly. docs/adaptive.md describes the whole algorithm.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

log = logging.getLogger("flashdraft.adaptive")

# Modes, in the order a fresh controller passes through them.
MEASURING_BASELINE, WARMUP, ACTIVE, OFF = "baseline", "warmup", "active", "off"
# Exploration steps visit, in turn: a longer length, a shorter one, a longer one, the full block.
EXPLORE_CYCLE = ("up", "down", "up", "full")
# A step time above this multiple of its length's mean counts as this multiple (a stall, not a new level).
OUTLIER_FACTOR = 2.0


@dataclass(frozen=True)
class AdaptiveConfig:
    """Tuning knobs; defaults follow BeeLlama's --spec-dm-profit-* except where docs/adaptive.md says why not."""

    alpha: float = 0.1               # EWMA weight of a new step time (the first 1/alpha samples are averaged)
    survival_alpha: float = 0.05     # EWMA weight of a new acceptance sample (0/1 samples are noisy: see docs)
    min_samples: int = 3             # samples a length's time / a position's survival needs before it counts
    warmup: int = 3                  # steps at the full block once the baseline is measured
    profit_min: float = 0.05         # drafting must beat plain decoding by this fraction to be switched back on
    raise_margin: float = 0.05       # a longer length must beat the current one by this fraction
    lower_margin: float = 0.05       # a shorter length must beat the current one by this fraction
    explore_interval: int = 12       # active steps between two exploration steps
    baseline_interval: int = 256     # active steps between two plain steps that re-measure the baseline
    off_shortfall: float = 0.5       # switch off once consecutive losing steps fell short of plain decoding by
                                     # this many plain steps in all (estimated): a bounded price for patience
    probe_interval: int = 16         # plain steps before the first probe once off
    max_backoff: int = 3             # the probe interval doubles per failed probe, at most this many times

    def validate(self) -> None:
        for name in ("alpha", "survival_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"adaptive {name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("profit_min", "raise_margin", "lower_margin"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"adaptive {name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 < self.off_shortfall <= 100:
            raise ValueError(f"adaptive off_shortfall must be in (0, 100], got {self.off_shortfall}")
        for name in ("min_samples", "warmup", "explore_interval", "baseline_interval", "probe_interval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"adaptive {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_backoff, int) or not 0 <= self.max_backoff <= 16:
            raise ValueError(f"adaptive max_backoff must be an integer in [0, 16], got {self.max_backoff!r}")


class Ewma:
    """Exponentially weighted mean whose first samples are averaged (weight max(alpha, 1/count)), so one early
    outlier does not dominate and the first sample initialises it."""

    __slots__ = ("alpha", "value", "count")

    def __init__(self, alpha: float):
        self.alpha, self.value, self.count = alpha, 0.0, 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += max(self.alpha, 1.0 / self.count) * (x - self.value)


def step_size(length: int) -> int:
    """How far one switch or exploration may move from `length`: coarser steps on long drafts."""
    return 4 if length >= 8 else 2


class AdaptiveDraft:
    """A DraftPolicy (next_length / record) choosing among lengths 0..max_draft; one per slot, it keeps learning
    across requests. state() is its JSON-able summary for /props and /metrics."""

    def __init__(self, max_draft: int, config: AdaptiveConfig | None = None):
        if not isinstance(max_draft, int) or max_draft < 0:
            raise ValueError(f"max_draft must be an integer >= 0, got {max_draft!r}")
        self.config = config or AdaptiveConfig()
        self.config.validate()
        self.base = max_draft
        # reach[p]: P(guess p accepted | guesses 0..p-1 were), from the steps that reached guess p. Survival of
        # position p is the product up to p, so a collapse at the first guesses shows at every depth at once.
        self.reach = [Ewma(self.config.survival_alpha) for _ in range(max_draft)]
        self.times = [Ewma(self.config.alpha) for _ in range(max_draft + 1)]  # index 0: plain decoding
        self.mode = MEASURING_BASELINE if max_draft > 0 else OFF
        self.length = 0              # the length drafted on ordinary steps (0 while off)
        self.steps = 0
        self.switches = 0
        self.warmup_left = self.config.warmup
        self.shortfall = 0.0         # summed 1 - score/baseline over the current run of losing decisions
        self.since_switch = 0        # ordinary steps at the current length
        self.since_explore = 0
        self.since_baseline = 0
        self.explored = 0            # exploration steps taken (picks the next kind in EXPLORE_CYCLE)
        self.off_steps = 0           # plain steps since switching off or since the last failed probe
        self.probe_failures = 0      # failed probes since drafting was last on (sets the backoff)
        self.probes = 0              # probes taken (alternates their length)
        self.probe_done = 0          # steps of the probe in progress
        self.probe_length = 0        # length of the probe in progress (it keeps one length)
        self._planned: tuple[str, int, int] | None = None  # (kind, length, exploration kinds skipped)

    # --- DraftPolicy -------------------------------------------------------------------------------------------

    def next_length(self, max_useful: int) -> int:
        self._planned = self._plan()
        return max(0, min(self._planned[1], max_useful))

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        if not isinstance(drafted, int) or not 0 <= drafted <= self.base:
            raise ValueError(f"drafted must be an integer in [0, {self.base}], got {drafted!r}")
        if not isinstance(accepted, int) or not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be an integer in [0, drafted={drafted}], got {accepted!r}")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"step seconds must be a finite number > 0, got {seconds!r}")
        self.steps += 1
        timing = self.times[drafted]
        if timing.count >= self.config.min_samples:  # one stall (GC, another process) must not swamp the mean
            seconds = min(seconds, OUTLIER_FACTOR * timing.value)
        timing.add(float(seconds))
        for p in range(min(accepted + 1, drafted)):  # the guesses this step reached: all accepted, then one not
            self.reach[p].add(1.0 if accepted > p else 0.0)
        planned, self._planned = self._planned, None
        if planned is not None:  # steps the policy did not choose (no next_length call) only teach it
            if planned[0] == "explore":
                self.explored += planned[2]  # skipped kinds count as visited, so the cycle moves on
            self._advance(planned[0], planned[1], drafted, accepted)

    # --- estimates ---------------------------------------------------------------------------------------------

    def baseline(self) -> float | None:
        """Plain decoding's tokens/s, once measured."""
        t = self.times[0]
        return 1.0 / t.value if t.count >= self.config.min_samples else None

    def _fit_cost(self) -> tuple[float, float] | None:
        """(a, b) of the cost model t(n) = a + b*n for drafting lengths not measured min_samples times. Two or more
        lengths with samples: the least-squares line through them (weights = sample counts capped at 1/alpha:
        older samples have faded from the EWMA anyway). One length r: the line from the baseline (0, t0) to
        (r, t_r), optimistic below r (it ignores the drafter's fixed cost), so that the controller goes and
        measures a shorter length rather than giving up on a guess."""
        cap = 1.0 / self.config.alpha
        sw = swn = swt = swnn = swnt = 0.0
        lengths = 0
        for n in range(1, self.base + 1):
            t = self.times[n]
            if t.count:
                w = min(t.count, cap)
                sw, swn, swt = sw + w, swn + w * n, swt + w * t.value
                swnn, swnt = swnn + w * n * n, swnt + w * n * t.value
                lengths += 1
        if lengths == 0:
            return None
        if lengths == 1:
            t0 = self.times[0]
            if not t0.count:
                return swt / sw, 0.0
            r, tr = swn / sw, swt / sw
            return t0.value, max(0.0, (tr - t0.value) / r)
        slope = max(0.0, (swnt * sw - swn * swt) / (swnn * sw - swn * swn))
        return (swt - slope * swn) / sw, slope

    def scores(self) -> dict[int, tuple[float, bool]]:
        """length -> (tokens/s, step time estimated) for the drafting lengths whose step time is measured or
        estimable (see _fit_cost), once the first guess has min_samples acceptance samples."""
        ready = self.config.min_samples
        if self.base == 0 or self.reach[0].count < ready:
            return {}
        fitted = self._fit_cost()
        floor = max(self.times[0].value, 1e-9)  # drafting never costs less than plain decoding
        cap = 1.0 / self.config.survival_alpha
        out = {}
        expected, survival, previous = 1.0, 1.0, self.reach[0].value
        for n in range(1, self.base + 1):
            # Deep guesses are reached rarely when acceptance is low: shrink each rate towards the one before
            # it (min_samples pseudo-samples), so a position with few samples neither blocks nor swings scores.
            r = self.reach[n - 1]
            w = min(r.count, cap)
            previous = (w * r.value + ready * previous) / (w + ready)
            survival *= previous
            expected += survival
            t = self.times[n]
            if t.count >= ready and fitted is not None:
                # Pooled with the fitted line (worth min_samples samples): neighbours' own noise cancels out.
                w = min(t.count, 1.0 / self.config.alpha)
                line = max(fitted[0] + fitted[1] * n, floor)
                out[n] = (expected * (w + ready) / (w * t.value + ready * line), False)
            elif t.count >= ready:
                out[n] = (expected / t.value, False)
            elif fitted is not None:
                out[n] = (expected / max(fitted[0] + fitted[1] * n, floor), True)
        return out

    # --- the schedule ------------------------------------------------------------------------------------------

    def _plan(self) -> tuple[str, int, int]:
        """(kind, length, exploration kinds skipped) of the next step."""
        cfg = self.config
        if self.mode == MEASURING_BASELINE:
            return "baseline", 0, 0
        if self.mode == WARMUP:
            return "warmup", self.base, 0
        if self.mode == OFF:
            if self.base > 0 and (self.probe_done > 0 or self.off_steps >= self._probe_wait()):
                return "probe", self._probe_length(), 0
            return "off", 0, 0
        if self.since_baseline >= cfg.baseline_interval:
            return "rebaseline", 0, 0
        if self.since_explore >= cfg.explore_interval:
            explore = self._explore_target()
            if explore is not None:
                return "explore", explore[1], explore[0]
        return "run", self.length, 0

    def _explore_target(self) -> tuple[int, int] | None:
        """(kinds skipped, length) of the next exploration: the next kind in EXPLORE_CYCLE that moves."""
        step = step_size(self.length)
        for i in range(len(EXPLORE_CYCLE)):
            kind = EXPLORE_CYCLE[(self.explored + i) % len(EXPLORE_CYCLE)]
            target = {"up": min(self.length + step, self.base), "down": max(self.length - step, 1),
                      "full": self.base}[kind]
            if target != self.length:
                return i, target
        return None

    def _probe_length(self) -> int:
        """Probes alternate between the full block (one step refreshes every position's survival) and the best
        drafting length by the latest scores (which may pay when long drafts do not)."""
        if self.probe_done:
            return self.probe_length
        best = self._best()
        return best[0] if self.probes % 2 and best is not None else self.base

    def _probe_wait(self) -> int:
        return self.config.probe_interval * 2 ** min(self.probe_failures, self.config.max_backoff)

    def _advance(self, kind: str, length: int, drafted: int, accepted: int) -> None:
        cfg = self.config
        if kind == "baseline":
            if self.times[0].count >= cfg.min_samples:
                self.mode = WARMUP
        elif kind == "warmup":
            if drafted > 0:  # a step clamped to 0 (end of the request, n_min) taught nothing about drafting
                self.warmup_left -= 1
            if self.warmup_left <= 0:
                self.mode, self.length = ACTIVE, self.base
                self.since_switch = self.since_explore = self.since_baseline = 0
                self._decide()
        elif kind == "off":
            self.off_steps += 1
        elif kind == "probe":
            if self.probe_done == 0:
                # What was learnt before is stale by now (the text has moved on): it becomes a weak prior of
                # min_samples samples' worth, so that this probe's few steps outweigh it.
                for r in self.reach:
                    r.count = min(r.count, cfg.min_samples)
            self.probe_length = length
            self._probe(accepted)
        else:  # an active step: run, explore or rebaseline
            self.since_baseline = 0 if kind == "rebaseline" else self.since_baseline + 1
            if kind == "explore":
                self.explored += 1
                self.since_explore = 0
            else:
                self.since_explore += 1
            self.since_switch += kind == "run"
            self._decide()

    def _probe(self, accepted: int) -> None:
        """A probe lasts min_samples steps, then drafting resumes at the best length if the scores say it pays.
        It ends at its first step if that step accepted nothing and the scores say drafting does not pay, so
        while drafting keeps losing a probe mostly costs one step."""
        self.probe_done += 1
        baseline, best = self.baseline(), self._best()
        pays = best is not None and baseline is not None and best[1] >= baseline * (1 + self.config.profit_min)
        if pays and self.probe_done >= self.config.min_samples:
            self.probe_done = self.probe_failures = 0
            self.shortfall = 0.0
            self.probes += 1
            self.mode = ACTIVE
            self.since_explore = self.since_baseline = 0
            self._switch(best[0])
        elif self.probe_done >= self.config.min_samples or (accepted == 0 and not pays):
            # Backoff grows on probes that failed at once; one that got going was close, so retry soon.
            self.probe_failures = self.probe_failures + 1 if self.probe_done == 1 else 0
            self.probe_done = 0
            self.probes += 1
            self.off_steps = 0

    def _best(self) -> tuple[int, float] | None:
        scores = self.scores()
        if not scores:
            return None
        n = max(scores, key=lambda k: scores[k][0])  # first (shortest) of equal scores
        return n, scores[n][0]

    def _decide(self) -> None:
        """After an active step. Best length slower than plain decoding: move to it (the least losing length,
        which also gets its step time measured) and switch off once the shortfall summed over the losing run
        reaches off_shortfall, never on an estimated time: a clear loss ends drafting at once, a marginal one
        only after many steps, so noise rarely switches it off. (Coming back needs the profit margin on top:
        the band in between keeps drafting from flapping on and off.) Otherwise move towards the best length when
        it beats the current one by the margin (at most step_size per switch, and only after min_samples steps
        at the current length, so each switch rests on measurements of where it stands)."""
        cfg = self.config
        baseline = self.baseline()
        scores = self.scores()
        if baseline is None or not scores:
            return
        target = max(scores, key=lambda k: scores[k][0])  # first (shortest) of equal scores
        score, estimated = scores[target]
        if score < baseline:
            self.shortfall += 1.0 - score / baseline
            if not estimated and self.shortfall >= cfg.off_shortfall:
                self._switch_off()
            elif target != self.length and self.times[self.length].count >= cfg.min_samples:
                self._switch(target)  # dwell on the least losing length, measuring it if its time is estimated
            return
        self.shortfall = 0.0
        if self.since_switch < cfg.min_samples:
            return
        current = scores.get(self.length)
        if current is None:
            self._switch(target)
        elif target > self.length and score > current[0] * (1 + cfg.raise_margin):
            self._switch(min(target, self.length + step_size(self.length)))
        elif target < self.length and score > current[0] * (1 + cfg.lower_margin):
            self._switch(max(target, self.length - step_size(self.length)))

    def _switch_off(self) -> None:
        self.mode = OFF
        self.off_steps = self.probe_done = 0
        self.shortfall = 0.0
        self._switch(0)

    def _score_of(self, length: int) -> float:
        if length == 0:
            return self.baseline() or 0.0
        s = self.scores().get(length)
        return s[0] if s else 0.0

    def _switch(self, new: int) -> None:
        old = self.length
        if new == old:
            return
        log.info("adaptive draft length: %d -> %d (score %.2f -> %.2f tok/s, baseline %.2f)", old, new,
                 self._score_of(old), self._score_of(new), self.baseline() or 0.0)
        self.length = new
        self.switches += 1
        self.since_switch = 0

    # --- reporting ---------------------------------------------------------------------------------------------

    def state(self) -> dict:
        """JSON-able summary: mode, current length, scores (tok/s) per ready length, baseline, switches."""
        baseline = self.baseline()
        return {
            "mode": self.mode,
            "length": self.length if self.mode == ACTIVE else 0,
            "max_length": self.base,
            "baseline_tok_s": baseline,
            "scores_tok_s": {str(n): s for n, (s, _) in self.scores().items()},
            "estimated_lengths": [n for n, (_, est) in self.scores().items() if est],
            "switches": self.switches,
            "steps": self.steps,
            "shortfall": self.shortfall,
            "probe_failures": self.probe_failures,
            "config": asdict(self.config),
        }
