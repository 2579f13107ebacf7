"""Adaptive draft length, after BeeLlama's 'profit' controller: draft the length (0 = plain decoding included)
that gives the most tokens per second, learned from what each step accepted and how long it took.

Per draft position p the controller keeps an EWMA of "guess p was accepted, given that the guesses before it
were"; their running product is the survival of position p (the chance a step commits guess p). Per draft length
it keeps a stall-robust mean step time, corrected for changes of the machine's load. A step drafting n guesses
is expected to commit E(n) = 1 + sum_{p<n} survival[p] tokens, so score(n) = E(n) / step_time(n) tokens/s;
length 0 (plain decoding) scores 1 / step_time(0), the baseline. Lengths whose step time was not measured borrow
a linear cost model fitted to the measured lengths.

Requests are short (bench's default is 128 tokens, 15-40 steps), so every step not at the best length counts:
a fresh controller starts at the full block (DFlash's cost is nearly flat in the length), measures the baseline
with one plain step when drafting wins clearly, and spaces its exploration steps and baseline re-measures by
their estimated cost. One controller per slot keeps learning across requests, so only the first request pays
the start. It is a pure function of the (drafted, accepted, seconds) triples it is fed: no clock, no randomness,
so simulations replay exactly. docs/adaptive.md describes the whole algorithm.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import asdict, dataclass

log = logging.getLogger("flashdraft.adaptive")

# Modes, in the order a fresh controller passes through them.
WARMUP, MEASURING_BASELINE, ACTIVE, OFF = "warmup", "baseline", "active", "off"
# Exploration steps visit, in turn: a longer length, a shorter one, a longer one, the full block.
EXPLORE_CYCLE = ("up", "down", "up", "full")
# A step time above this multiple of its length's mean counts as this multiple (a stall, not a new level); among
# a length's first min_samples times, one above this multiple of their lower median is left out.
OUTLIER_FACTOR = 1.5
# A change of the machine's load shows as this many step times of the reference length in a row beyond this
# factor of its mean (see AdaptiveDraft._time).
LOAD_WINDOW = 5
LOAD_SHIFT = 1.3
# A step time under 1/STALE_FACTOR of its length's mean starts the mean again (see Timing).
STALE_FACTOR = 3.0
# An exploration expected to lose a lot waits longer (see explore_budget), at most this many explore_intervals.
MAX_EXPLORE_WAIT = 16
# When drafting wins big, baseline re-measures wait up to this many baseline_intervals (see baseline_budget).
MAX_BASELINE_WAIT = 4
# While the baseline has fewer than min_samples timings, the next plain step comes within this many
# explore_intervals even when drafting wins clearly (one stalled plain step must not stand for long).
UNSETTLED_BASELINE_WAIT = 4


@dataclass(frozen=True)
class AdaptiveConfig:
    """Tuning knobs; defaults follow BeeLlama's --spec-dm-profit-* except where docs/adaptive.md says why not."""

    alpha: float = 0.1               # EWMA weight of a new step time (the first 1/alpha samples are averaged)
    survival_alpha: float = 0.05     # EWMA weight of a new acceptance sample (0/1 samples are noisy: see docs)
    min_samples: int = 3             # samples a length's time / a position's survival needs before it counts
    warmup: int = 3                  # full-block steps a fresh controller starts with
    clear_win: float = 0.5           # after the warm-up, one plain step is baseline enough if drafting beats it
                                     # by this fraction (more plain steps follow, spread out); else min_samples
    profit_min: float = 0.05         # drafting must beat plain decoding by this fraction to be switched back on
    raise_margin: float = 0.05       # a longer length must beat the current one by this fraction
    lower_margin: float = 0.05       # a shorter length must beat the current one by this fraction
    explore_interval: int = 12       # fewest active steps between two exploration steps
    explore_budget: float = 0.005    # an exploration expected to lose a fraction x of a step waits x / budget
                                     # steps (so exploring costs about this fraction of throughput at most)
    baseline_interval: int = 256     # fewest active steps between two plain steps that re-measure the baseline
    baseline_budget: float = 0.001   # more when drafting wins big: a plain step loses 1 - baseline/best of a
                                     # step, and waits that loss over the budget (up to 4 baseline_intervals)
    off_shortfall: float = 1.0       # switch off once consecutive losing steps fell short of plain decoding by
                                     # this many plain steps in all (estimated): a bounded price for patience
    probe_interval: int = 16         # plain steps before the first probe once off
    probe_patience: float = 0.1      # a probe step that accepted nothing ends the probe unless the best score
                                     # is within this fraction below the baseline
    max_backoff: int = 3             # the probe interval doubles per failed probe, at most this many times

    def validate(self) -> None:
        for name in ("alpha", "survival_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"adaptive {name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("profit_min", "raise_margin", "lower_margin"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"adaptive {name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("explore_budget", "baseline_budget", "probe_patience"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"adaptive {name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.clear_win <= 100:
            raise ValueError(f"adaptive clear_win must be in [0, 100], got {self.clear_win}")
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


class Timing:
    """Mean step time of one draft length, robust to stalls (GC, another process on the machine): the mean of
    those of the first `robust` samples within OUTLIER_FACTOR of their lower median (a stall among the first
    three, or one of the first two, is left out), then an EWMA (weight max(alpha, 1/count)) whose samples are
    capped at OUTLIER_FACTOR times the mean. Noise only makes a step slower, so a sample under 1/STALE_FACTOR
    of the mean means the mean is stale (timed while a fresh process was still slow, or in a busy spell):
    it starts again from that sample."""

    __slots__ = ("alpha", "count", "first", "robust", "value")

    def __init__(self, alpha: float, robust: int):
        self.alpha, self.robust, self.value, self.count, self.first = alpha, robust, 0.0, 0, []

    def reset(self) -> None:
        self.value, self.count, self.first = 0.0, 0, []

    def add(self, x: float) -> None:
        self.count += 1
        if self.count <= self.robust:
            self.first.append(x)
            cap = OUTLIER_FACTOR * sorted(self.first)[(len(self.first) - 1) // 2]
            kept = [v for v in self.first if v <= cap]
            self.value = sum(kept) / len(kept)
            return
        if x * STALE_FACTOR < self.value:  # noise only slows steps down: the mean is stale, start again
            self.count, self.first, self.value = 1, [x], x
            return
        self.first = []
        self.value += max(self.alpha, 1.0 / self.count) * (min(x, OUTLIER_FACTOR * self.value) - self.value)


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
        # index 0: plain decoding
        self.times = [Timing(self.config.alpha, self.config.min_samples) for _ in range(max_draft + 1)]
        self.mode = WARMUP if max_draft > 0 else OFF
        self.length = 0              # the length drafted on ordinary steps (0 while off)
        self.steps = 0
        self.switches = 0
        self.warmup_left = self.config.warmup
        self.shortfall = 0.0         # summed 1 - score/baseline over the current run of losing decisions
        self.since_switch = 0        # ordinary steps at the current length
        self.tentative_from: int | None = None  # the length left for one whose step time was an estimate
        self.since_explore = 0
        self.since_baseline = 0
        self.explored = 0            # exploration steps taken (picks the next kind in EXPLORE_CYCLE)
        self.off_steps = 0           # plain steps since switching off or since the last failed probe
        self.probe_failures = 0      # failed probes since drafting was last on (sets the backoff)
        self.probes = 0              # probes taken (alternates their length)
        self.probe_done = 0          # steps of the probe in progress
        self.probe_length = 0        # length of the probe in progress (it keeps one length)
        self.load = 1.0              # machine load: step time / load-free step time (see _time)
        self._loads: deque[float] = deque(maxlen=LOAD_WINDOW)
        # (kind, length, exploration kinds skipped) of each length handed out and not yet recorded, oldest first:
        # with pipelined steps the next step's length is chosen before this one's result is recorded
        self._planned: deque[tuple[str, int, int]] = deque()
        self._scores: dict[int, tuple[float, bool]] | None = None  # scores() until the next record()

    # --- DraftPolicy -------------------------------------------------------------------------------------------

    def next_length(self, max_useful: int) -> int:
        self._planned.append(self._plan())
        return max(0, min(self._planned[-1][1], max_useful))

    def unplan(self, count: int) -> None:
        """Forget the last `count` lengths handed out: their steps were dropped unrecorded (queued past a
        request's end)."""
        for _ in range(min(count, len(self._planned))):
            self._planned.pop()

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        if not isinstance(drafted, int) or not 0 <= drafted <= self.base:
            raise ValueError(f"drafted must be an integer in [0, {self.base}], got {drafted!r}")
        if not isinstance(accepted, int) or not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be an integer in [0, drafted={drafted}], got {accepted!r}")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"step seconds must be a finite number > 0, got {seconds!r}")
        self.steps += 1
        planned = self._planned.popleft() if self._planned else None
        if planned is not None and planned[0] == "probe" and self.probe_done == 0 and drafted > 0:
            # What was learnt before switching off is stale by now (the text has moved on): acceptance becomes a
            # weak prior of min_samples samples' worth, so that this probe's few steps outweigh it.
            for r in self.reach:
                r.count = min(r.count, self.config.min_samples)
        self._time(drafted, float(seconds))
        self._drop_implausible_times()
        for p in range(min(accepted + 1, drafted)):  # the guesses this step reached: all accepted, then one not
            self.reach[p].add(1.0 if accepted > p else 0.0)
        self._scores = None
        if planned is not None:  # steps the policy did not choose (no next_length call) only teach it
            if planned[0] == "explore":
                self.explored += planned[2]  # skipped kinds count as visited, so the cycle moves on
            self._advance(planned[0], planned[1], drafted, accepted)

    def _time(self, drafted: int, seconds: float) -> None:
        """Learn a step time. The machine's load (other processes, frequency scaling) changes every length's step
        time alike, and a busy spell can last thousands of steps: lengths timed before it must not be compared
        raw with lengths timed during it. The reference length (the one drafted on ordinary steps: the current
        length, the full block in the warm-up, 0 while off) watches the load through the ratios of its last
        LOAD_WINDOW step times to its mean. While not all of them lie beyond a factor LOAD_SHIFT (the same
        side), every length learns its raw times, the reference too from its steps within LOAD_SHIFT - 1
        (30%) of its mean (small drifts, such as a growing context, are tracked; a stall is left out). Once
        they all do, the load is their median: the reference's mean stays as it is, and every other length's
        time is divided by the load, so that it is measured against the reference as it runs now
        (exploration, baseline and probe steps become paired comparisons). Noise that comes and goes from one
        step to the next rarely puts LOAD_WINDOW steps in a row beyond the factor; a busy spell does at once."""
        cfg = self.config
        timing = self.times[drafted]
        if drafted == self._reference() and timing.count >= cfg.min_samples:
            ratio = seconds / timing.value
            loads = self._loads
            loads.append(ratio)
            if len(loads) == LOAD_WINDOW and (min(loads) > LOAD_SHIFT or max(loads) < 1.0 / LOAD_SHIFT):
                self.load = sorted(loads)[LOAD_WINDOW // 2]
            else:
                self.load = 1.0
                if 2.0 - LOAD_SHIFT < ratio < LOAD_SHIFT:  # a stall or the start of a busy spell is left out
                    timing.add(seconds)
            return
        seconds /= self.load
        if drafted == 0 and timing.count < cfg.min_samples:
            # A plain step costs no more than a drafting step (it is that step's verify pass on one token): while
            # the baseline rests on a sample or two, a stalled plain step must not make drafting look better.
            fastest = min((t.value for t in self.times[1:] if t.count), default=None)
            if fastest is not None:
                seconds = min(seconds, fastest)
        timing.add(seconds)

    def _reference(self) -> int:
        return self.length if self.mode == ACTIVE else (0 if self.mode == OFF else self.base)

    def _drop_implausible_times(self) -> None:
        """Forget a step-time mean that contradicts how DFlash steps cost, by more than OUTLIER_FACTOR: a plain
        step costs no more than a drafting step, a shorter draft no more than a longer one (the drafter runs the
        whole block either way; the verify pass has fewer tokens), and n guesses no more than (n+1)/(m+1) times
        m guesses for m < n (the verify pass is at worst linear in its tokens). Noise only makes steps slower,
        so the larger mean is the stale one: timed while the process was still warming up (a fresh process's
        first steps, and each new shape's first call, ran 10-50x slower on the development machine) or during a
        busy spell. Forgotten, the length is priced by the cost line again, and re-timed when it runs."""
        times, k = self.times, OUTLIER_FACTOR
        dropped = []
        lowest_after = math.inf  # the smallest mean of the longer lengths seen so far (scanning downwards)
        for n in range(self.base, -1, -1):
            t = times[n]
            if t.count and t.value > k * lowest_after:
                dropped.append(n)
            elif t.count:
                lowest_after = min(lowest_after, t.value)
        per_token = math.inf  # the smallest mean per verified token of the shorter drafting lengths (scanning up)
        for n in range(1, self.base + 1):
            t = times[n]
            if t.count and n not in dropped and t.value > k * per_token * (n + 1):
                dropped.append(n)
            elif t.count and n not in dropped:
                per_token = min(per_token, t.value / (n + 1))
        for n in dropped:
            times[n].reset()
            if n == self._reference():
                self._loads.clear()  # ratios to the forgotten mean; the load stands until it is re-timed

    # --- estimates ---------------------------------------------------------------------------------------------

    def baseline(self) -> float | None:
        """Plain decoding's tokens/s, once a plain step was timed (settled after min_samples of them)."""
        t = self.times[0]
        return 1.0 / t.value if t.count else None

    def _fit_cost(self, expected: list[float]) -> tuple[float, float, float] | None:
        """(a, b, r) of the cost model t(n) = a + b*min(n, r) for drafting lengths not measured min_samples
        times. Two or more lengths with min_samples timings: the least-squares line through them (weights =
        sample counts capped at 1/alpha: older samples have faded from the EWMA anyway; r infinite); a slope
        resting on a timing or two of a second length is mostly noise, and on a flat cost it sent the
        controller down to short lengths. One such length r (or, before any, the mean of those timed): flat at
        t_r while drafting r beats plain decoding (expected[r] tokens per step; DFlash drafts the whole block in
        one pass, so long drafts cost about what short ones do: the prior favours the long ones, and
        exploration steps time a shorter length for a real slope). While it loses, or is not compared yet:
        below r the line from the baseline (0, t0) to (r, t_r), optimistic (it ignores the drafter's fixed
        cost), so that the controller goes and measures a shorter length rather than giving up on drafting;
        flat above r, as optimistic (a line that steep would price the long drafts out after a short one)."""
        cap, ready = 1.0 / self.config.alpha, self.config.min_samples
        for least in (ready, 1):
            sw = swn = swt = swnn = swnt = 0.0
            lengths = 0
            for n in range(1, self.base + 1):
                t = self.times[n]
                if t.count >= least:
                    w = min(t.count, cap)
                    sw, swn, swt = sw + w, swn + w * n, swt + w * t.value
                    swnn, swnt = swnn + w * n * n, swnt + w * n * t.value
                    lengths += 1
            if lengths >= 2 and least == ready:
                slope = max(0.0, (swnt * sw - swn * swt) / (swnn * sw - swn * swn))
                return (swt - slope * swn) / sw, slope, math.inf
            if lengths:
                t0 = self.times[0]
                r, tr = round(swn / sw), swt / sw
                if not t0.count or expected[r] * t0.value >= tr:
                    return tr, 0.0, math.inf
                return t0.value, max(0.0, (tr - t0.value) / r), r
        return None

    def scores(self) -> dict[int, tuple[float, bool]]:
        """length -> (tokens/s, step time estimated) for the drafting lengths whose step time is measured or
        estimable (see _fit_cost), once the first guess has min_samples acceptance samples."""
        if self._scores is None:
            self._scores = self._compute_scores()
        return self._scores

    def _compute_scores(self) -> dict[int, tuple[float, bool]]:
        ready = self.config.min_samples
        if self.base == 0 or self.reach[0].count < ready:
            return {}
        cap, shrink = 1.0 / self.config.survival_alpha, 2 * ready
        expected, survival, previous = [1.0], 1.0, self.reach[0].value  # expected[n] = E(n)
        for n in range(1, self.base + 1):
            # Deep guesses are reached rarely (when acceptance is low, or only by exploration steps): shrink each
            # rate towards the one before it (2 * min_samples pseudo-samples), so that a position with few
            # samples neither blocks nor swings scores (one unlucky guess deep in a warm-up step would otherwise
            # cut the survival of every deeper position for long).
            r = self.reach[n - 1]
            w = min(r.count, cap)
            previous = (w * r.value + shrink * previous) / (w + shrink)
            survival *= previous
            expected.append(expected[-1] + survival)
        fitted = self._fit_cost(expected)
        floor = max(self.times[0].value, 1e-9)  # drafting never costs less than plain decoding
        weight_cap = 1.0 / self.config.alpha
        out = {}
        for n in range(1, self.base + 1):
            t = self.times[n]
            if fitted is not None:
                line = max(fitted[0] + fitted[1] * min(n, fitted[2]), floor)
                if t.count >= ready:
                    # Pooled with the fitted line (worth min_samples samples): neighbours' own noise cancels out.
                    w = min(t.count, weight_cap)
                    out[n] = (expected[n] * (w + ready) / (w * t.value + ready * line), False)
                else:
                    out[n] = (expected[n] / line, True)
            elif t.count >= ready:
                out[n] = (expected[n] / t.value, False)
        return out

    def _best(self) -> tuple[int, float] | None:
        scores = self.scores()
        if not scores:
            return None
        n = max(scores, key=lambda k: scores[k][0])  # first (shortest) of equal scores
        return n, scores[n][0]

    def _baseline_needed(self) -> bool:
        """Plain steps are due now: no baseline yet, or fewer than min_samples timings of it while drafting
        does not beat it by clear_win (then deciding whether drafting pays needs a settled baseline)."""
        t0 = self.times[0]
        if t0.count >= self.config.min_samples:
            return False
        best = self._best()
        return t0.count == 0 or best is None or best[1] * t0.value < 1 + self.config.clear_win

    def _baseline_wait(self) -> float:
        """Active steps between two plain steps that re-measure the baseline. A plain step loses 1 - baseline/best
        of a step, so when drafting wins big the wait is that loss over baseline_budget (the baseline matters
        little then), at least baseline_interval and at most MAX_BASELINE_WAIT times it; at most
        UNSETTLED_BASELINE_WAIT explore_intervals while the baseline has fewer than min_samples timings."""
        cfg = self.config
        if self._baseline_needed():
            return 0
        best, t0 = self._best(), self.times[0]
        ratio = best[1] * t0.value if best is not None else 1.0
        wait = cfg.baseline_interval
        if ratio > 1:
            wait = min(max(wait, (1.0 - 1.0 / ratio) / cfg.baseline_budget), MAX_BASELINE_WAIT * wait)
        if t0.count < cfg.min_samples:
            wait = min(wait, UNSETTLED_BASELINE_WAIT * cfg.explore_interval)
        return wait

    def _explore_wait(self, target: int) -> int:
        """Active steps before exploring `target`: explore_interval, or longer when the scores say the step would
        lose a fraction x of a step (x / explore_budget steps, so that exploring costs about explore_budget of
        throughput), at most MAX_EXPLORE_WAIT explore_intervals (the scores of unvisited lengths may be wrong).
        Only min_samples while a single drafting length is timed: the cost line needs a second one."""
        cfg = self.config
        if sum(t.count > 0 for t in self.times[1:]) < 2:
            return cfg.min_samples  # one drafting length timed: time a second one soon, for the cost line's slope
        scores = self.scores()
        current, other = scores.get(self.length), scores.get(target)
        wait = cfg.explore_interval
        if current is not None and other is not None and other[0] < current[0]:
            wait = max(wait, math.ceil((1.0 - other[0] / current[0]) / cfg.explore_budget))
        return min(wait, MAX_EXPLORE_WAIT * cfg.explore_interval)

    # --- the schedule ------------------------------------------------------------------------------------------

    def _plan(self) -> tuple[str, int, int]:
        """(kind, length, exploration kinds skipped) of the next step."""
        cfg = self.config
        if self.mode == WARMUP:
            return "warmup", self.base, 0
        if self.mode == MEASURING_BASELINE:
            return "baseline", 0, 0
        if self.mode == OFF:
            if self.base > 0 and (self.probe_done > 0 or self.off_steps >= self._probe_wait()):
                return "probe", self._probe_length(), 0
            return "off", 0, 0
        if self.since_baseline >= self._baseline_wait():
            return "rebaseline", 0, 0
        if self.since_explore >= cfg.min_samples:
            explore = self._explore_target()
            if explore is not None and self.since_explore >= self._explore_wait(explore[1]):
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
        if kind == "warmup":
            if drafted > 0:  # a step clamped to 0 (end of the request, n_min) taught nothing about drafting
                self.warmup_left -= 1
            if self.warmup_left <= 0:
                self.mode = MEASURING_BASELINE
                self._end_baseline()
        elif kind == "baseline":
            self._end_baseline()
        elif kind == "off":
            self.off_steps += 1
        elif kind == "probe":
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

    def _end_baseline(self) -> None:
        """After the warm-up or a plain step of the start: go active at the full block once the baseline will do."""
        if self._baseline_needed():
            return
        self.mode, self.length = ACTIVE, self.base
        self.since_switch = self.since_explore = self.since_baseline = 0
        self._decide()

    def _probe(self, accepted: int) -> None:
        """A probe lasts min_samples steps, then drafting resumes at the best length if the scores say it pays.
        A step that accepted nothing ends it early when the best score is more than probe_patience below the
        baseline, so while drafting clearly loses a probe mostly costs one step; when it is nearer, the probe
        goes on (where acceptance is low but drafting pays a little, a step that accepts nothing is common, and
        ending on it would keep drafting off)."""
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
        elif self.probe_done >= self.config.min_samples or (accepted == 0 and not self._near(best, baseline)):
            # Backoff grows on probes that failed clearly; one whose best score reached the baseline was close
            # (within the profit margin), so retry soon.
            close = best is not None and baseline is not None and best[1] >= baseline
            self.probe_failures = 0 if close else self.probe_failures + 1
            self.probe_done = 0
            self.probes += 1
            self.off_steps = 0

    def _near(self, best: tuple[int, float] | None, baseline: float | None) -> bool:
        return best is not None and baseline is not None and best[1] >= baseline * (1 - self.config.probe_patience)

    def _decide(self) -> None:
        """After an active step. No decision while plain steps are due (the baseline is not settled and drafting
        does not win clearly). Best length slower than plain decoding: move to it (the least losing length,
        which also gets its step time measured) and switch off once the shortfall summed over the losing run
        reaches off_shortfall, never on an estimated time: a clear loss ends drafting within a few steps, a
        marginal one only after many, so noise rarely switches it off.
        (Coming back needs the profit margin on top: the band in between keeps drafting from flapping on and
        off.) Otherwise move towards the best length when it beats the current one by the margin (down by at
        most step_size per switch, up by step_size or half the way; only after min_samples steps at the current
        length, so each switch rests on measurements of where it stands)."""
        cfg = self.config
        baseline = self.baseline()
        scores = self.scores()
        if baseline is None or not scores or self._baseline_needed():
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
        came_from, self.tentative_from = self.tentative_from, None
        # The last switch rested on an estimated step time, now measured: if the length it left scores better
        # after all, go back without asking for the margin (the estimate, not noise, moved it).
        if (came_from is not None and current is not None and came_from in scores
                and scores[came_from][0] > current[0]):
            self._switch(came_from)
            return
        if current is None:
            new = target
        elif target > self.length and score > current[0] * (1 + cfg.raise_margin):
            # Up by a step, or half the way when the best is far above (long drafts are the prior).
            new = min(target, self.length + max(step_size(self.length), (target - self.length) // 2))
        elif target < self.length and score > current[0] * (1 + cfg.lower_margin):
            new = max(target, self.length - step_size(self.length))
        else:
            return
        old = self.length
        self._switch(new)
        if current is not None and scores.get(new, (0.0, False))[1]:
            self.tentative_from = old

    def _switch_off(self) -> None:
        self.mode = OFF
        self.tentative_from = None
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
                 self._score_of(old) / self.load, self._score_of(new) / self.load, (self.baseline() or 0.0) / self.load)
        self.length = new
        self.switches += 1
        self.since_switch = 0

    # --- reporting ---------------------------------------------------------------------------------------------

    def state(self) -> dict:
        """JSON-able summary: mode, current length, scores (tok/s) per ready length, baseline, switches."""
        baseline = self.baseline()
        scores = self.scores()
        return {
            "mode": self.mode,
            "length": self.length if self.mode == ACTIVE else 0,
            "max_length": self.base,
            "baseline_tok_s": None if baseline is None else baseline / self.load,
            "scores_tok_s": {str(n): s / self.load for n, (s, _) in scores.items()},
            "load": self.load,
            "estimated_lengths": [n for n, (_, est) in scores.items() if est],
            "switches": self.switches,
            "steps": self.steps,
            "shortfall": self.shortfall,
            "probe_failures": self.probe_failures,
            "config": asdict(self.config),
        }
