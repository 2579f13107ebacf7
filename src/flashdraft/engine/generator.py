"""Generation around the DFlash loop: prompt checks, stop rules, incremental text, statistics, streaming; and the
draft policies that pick each step's draft length (fixed, or the adaptive controller)."""
from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol

from flashdraft.config import PREFILL_CHUNK, Constraint, SamplingParams
from flashdraft.loading.tokenizer import IncrementalText
from flashdraft.engine.grammar import GrammarCompiler
from flashdraft.engine.logit_processor import TokenLogprob
from flashdraft.engine.model_prep import resolve_plan
from flashdraft.engine.ngram import NgramSettings
from flashdraft.engine.speculative import Oracle, Sequence, SpeculativeDecoder, resolve_seed
from flashdraft.loading import Tokenizer
from flashdraft.loading.checkpoint import default_device_dtype
from flashdraft.models import drafter_block_size, load_model

# Caches get this many rows past the context so that any supported block can overhang the last position.
MAX_BLOCK_SIZE = 64

log = logging.getLogger("flashdraft")


class DraftPolicy(Protocol):
    """Chooses the draft length before each step and learns from what the step gave."""

    def next_length(self, max_useful: int) -> int: ...

    def record(self, drafted: int, accepted: int, seconds: float) -> None: ...


@dataclass
class FixedDraft:
    """Always the same draft length (0 = plain decoding)."""

    length: int

    def next_length(self, max_useful: int) -> int:
        return min(self.length, max_useful)

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        pass



# Adaptive drafting.
#
# Adaptive drafting: draft the full block while the drafter's acceptance pays for what a drafting step costs,
# decode plainly while it does not, and probe back with backoff.
#
# Decisions come from acceptance statistics and a cost model fixed when the controller is made (DraftCost,
# estimated once from the models' weights and the device by estimate_cost), never from step timings: the
# controller reads no clock and uses no randomness, so the same (drafted, accepted) history gives the same
# decisions. Greedy runs are therefore reproducible in their draft lengths and tau on a busy machine too.
#
# - Acceptance: E(n), the tokens a step drafting n guesses commits (min(correct guesses, n) + 1), as an EWMA over
#   the drafting steps; one full-block step tells it for every n at once.
# - Cost: a step drafting n guesses costs R(n) = 1 + fixed + per_token * n plain steps. Where S streams step
#   together (a server's batched steps), R is that of a batched step of S streams drafting n against one of S
#   plain streams (estimate_cost's streams): the verify rows of all streams share one pass, which stops being
#   nearly free once they are many (a CPU's products early, a GPU's once the rows' arithmetic outweighs the
#   weights' reads), so drafting switches off where the batch would go faster without it.
# - Gain G(n) = E(n) / R(n): throughput relative to plain decoding. Drafting stays on while G(full block) >= 1
#   (losing steps are summed, so one unlucky step does not switch it off), and a probe switches it back on when
#   G >= 1 + profit_min.
#
# One stream drafts only the full block (also at a request's end: a graphed step keeps its shape): DFlash drafts
# the whole block in one pass, so a long draft costs hardly more than a short one, and docs/adaptive.md found that
# searching the length did not pay where switching drafting on and off did. Several streams stepping together
# draft one length (batch_length): among 2^k - 1 and the block (verify rows a power of two), the one of the largest
# summed gain of the batch's drafting streams; there every verify row is arithmetic on every weight (on the H200 a
# 64-row batched pass costs 2.5x a 16-row one), so guesses past the expected run cost more than they bring. After
# a step whose guesses were all right the batch drafts the full block, so E(n) of the longer lengths follows the
# text. One length for all keeps a batch's compositions (each a CUDA graph) few. docs/adaptive.md describes the
# algorithm and its evidence.

adaptive_log = logging.getLogger("flashdraft.adaptive")

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
    """What a step drafting n guesses costs, in plain decoding steps: 1 + fixed + per_token * n (n > 0), or
    ratios[n] where given (estimate_cost's, exact where a batched pass's cost bends at 16 rows). The default is a
    middle guess for a pair whose cost was not estimated (see estimate_cost)."""

    fixed: float = 1.0
    per_token: float = 0.02
    ratios: tuple[float, ...] = ()  # ratios[n] for n = 0 .. block - 1 (ratios[0] = 1)

    def __post_init__(self):
        for name in ("fixed", "per_token"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1e6):
                raise ValueError(f"draft cost {name} must be a number >= 0, got {value!r}")
        if not all(isinstance(r, (int, float)) and 1 <= r < 1e6 for r in self.ratios):
            raise ValueError(f"draft cost ratios must be numbers >= 1 (plain steps a step costs), got {self.ratios!r}")

    def ratio(self, n: int) -> float:
        if 0 < n < len(self.ratios):
            return self.ratios[n]
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
    """A DraftPolicy (next_length / record) that drafts the full block or nothing (several streams stepping
    together: the length that pays best, see above); one per slot, it keeps learning across requests. state() is
    its JSON-able summary for /props and /metrics. batch_cost: the cost of a batched step of S streams
    (set_streams), None: the cost of one stream's whatever the batch."""

    def __init__(self, max_draft: int, config: AdaptiveConfig | None = None, cost: DraftCost | None = None,
                 batch_cost: Callable[[int], DraftCost] | None = None):
        if not isinstance(max_draft, int) or max_draft < 0:
            raise ValueError(f"max_draft must be an integer >= 0, got {max_draft!r}")
        self.config = config or AdaptiveConfig()
        self.config.validate()
        self.cost = cost or DraftCost()
        self.batch_cost = batch_cost
        self.streams = 1  # streams stepping together (set_streams)
        self.batch_length: int | None = None  # the one length of the batch's drafting streams (set_streams)
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
        self.all_right = False       # the last drafting step shorter than the block had every guess right
        # Kinds of the steps handed out and not yet recorded, with the length chosen before a request's cap, oldest
        # first: with pipelined steps the next step's length is chosen before this one's result is recorded.
        self._planned: deque[tuple[str, int]] = deque()

    def __deepcopy__(self, memo: dict) -> "AdaptiveDraft":
        """A copy of what the controller has learnt (benchmarks start each prompt from the same state), sharing
        batch_cost: a function of the engine's models, not state to copy."""
        twin = AdaptiveDraft.__new__(AdaptiveDraft)
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            setattr(twin, name, value if name == "batch_cost" else copy.deepcopy(value, memo))
        return twin

    @classmethod
    def for_engine(cls, engine, config: AdaptiveConfig | None = None) -> "AdaptiveDraft":
        """A controller priced for an engine's target and drafter on its device (estimate_cost)."""
        if engine.decoder.drafter is None:
            return cls(engine.max_draft, config)
        return cls(engine.max_draft, config, engine.draft_cost(1), engine.draft_cost)

    @property
    def length(self) -> int:
        """The length drafted on ordinary steps: 0 while off; while on the full block, or with several streams
        stepping together the batch's length (set_streams: batch_length), else the candidate length of the best
        expected gain, the longer on a tie, the full block after a shorter step had every guess right."""
        if self.mode != ON:
            return 0
        if self.streams == 1 or not self._ready():
            return self.base
        if self.batch_length is not None:
            return self.batch_length
        if self.all_right:
            return self.base
        return max(self.candidates(), key=lambda n: (self.gain(n), n))

    def candidates(self) -> list[int]:
        """The lengths drafted with several streams: 2^k - 1 below the block, and the block (verify rows a power
        of two)."""
        return [n for n in (2 ** k - 1 for k in range(1, self.base.bit_length() + 1)) if n < self.base] + [self.base]

    def set_streams(self, streams: int, length: int | None = None) -> None:
        """How many streams' steps run together from now on (a server's batched steps): the cost the decisions
        price drafting at; length: the batch's length for its drafting streams (batch_length), None: this
        policy's own choice."""
        if not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be an integer >= 1, got {streams!r}")
        if length is not None and length not in self.candidates():
            raise ValueError(f"a batch's length must be one of {self.candidates()}, got {length!r}")
        self.streams = streams
        self.batch_length = length

    def step_cost(self) -> DraftCost:
        """The cost model of the steps now: one stream's, or a batched step's of the streams stepping together."""
        return self.batch_cost(self.streams) if self.streams > 1 and self.batch_cost is not None else self.cost

    # --- DraftPolicy -------------------------------------------------------------------------------------------

    def next_length(self, max_useful: int) -> int:
        if self.mode == ON:
            length = self.length
            n = max(0, min(length, max_useful))
            # Fewer guesses than chosen (a request's n_max, the end of the context) may not pay for the drafter
            # pass, which costs the same: decode plainly then.
            if 0 < n < length and self._ready() and self.gain(n) < 1.0:
                n = 0
            self._planned.append((DRAFT, length))
            return n
        if self.base > 0 and (self.probing or self.off_steps >= self._probe_wait()):
            self.probing = True
            self._planned.append((PROBE, self.base))
            return max(0, min(self.base, max_useful))
        self._planned.append((PLAIN, 0))
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
        kind, chosen = self._planned.popleft() if self._planned else (None, 0)
        probe = kind == PROBE and self.mode == OFF and self.probing and drafted > 0
        if probe and self.probe_done == 0:
            # What was learnt before switching off is stale by now (the text has moved on, and it was what
            # switched drafting off): the probe starts the acceptance statistics afresh.
            for t in self.tokens:
                t.count = 0
        for n in range(1, drafted + 1):
            self.tokens[n].add(min(accepted, n) + 1.0)
        if drafted > 0:  # (a step a request's end cut short tells nothing of longer runs)
            self.all_right = accepted == drafted == chosen < self.base
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
        return self.expected_tokens(n) / self.step_cost().ratio(n)

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
        adaptive_log.info("adaptive drafting %s (expected %.2f tokens per step at length %d, step cost %.2f plain steps: "
                 "gain %.2f; %d stream(s))", mode, self.expected_tokens(length), length, self.step_cost().ratio(length),
                 self.gain(length), self.streams)

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
            "step_cost": self.step_cost().ratio(self.base),
            "gain": self.gain() if ready else None,
            "cost": asdict(self.cost),
            "streams": self.streams,
            "switches": self.switches,
            "steps": self.steps,
            "shortfall": self.shortfall,
            "probe_failures": self.probe_failures,
            "config": asdict(self.config),
        }


def batch_length(policies: list[AdaptiveDraft]) -> int | None:
    """One draft length for the drafting streams of a batched step (their policies, of one engine): each
    composition of a batched step (its streams and their lengths) is a CUDA graph, and per-stream lengths made a new
    one at most rounds (docs/performance.md). The full block after any stream's step had every guess right at a
    shorter length (so that the longer lengths' acceptance follows the text), else the candidate length of the
    largest summed expected gain, sum_i E_i(n) / R(n) (the streams share the step, so that is tokens per unit of
    its cost), the longer on a tie. None where no policy is drafting on its estimates yet (each drafts the block)."""
    deciding = [p for p in policies if p.mode == ON and p._ready()]
    if not deciding:
        return None
    if any(p.all_right for p in deciding):
        return deciding[0].base
    return max(deciding[0].candidates(), key=lambda n: (sum(p.gain(n) for p in deciding), n))


def set_batch(policies: list[AdaptiveDraft], streams: int) -> None:
    """Tell the policies of the streams stepping together (a server's round) their count, and with several the one
    length their drafting steps take (batch_length)."""
    length = batch_length(policies) if streams > 1 else None
    for policy in policies:
        policy.set_streams(streams, length)


# --- the cost model -----------------------------------------------------------------------------------------------
# A decoding step is dominated by reading the weights (GPU, and a CPU's one-row matrix-vector products) or by the
# arithmetic on them (a CPU's multi-row products, a GPU's past a block). Per weight byte, a pass of T rows costs
# rows_factor(T) times a one-row pass: on CUDA the passes of up to a block are memory-bound (1 + 0.004 per extra row:
# the synthetic Qwen3-8B pair's measured step cost), and each row past 16 adds 0.008 (set from the 64-row tiles that
# batched passes take since 2026-12-05: Qwen3-8B's layer GEMMs 1.07x their 16-row time at 64 rows, 2.10x at 256, on
# an H100; the whole batched DFlash steps measured after, on an H100, 1.22x / 1.57x / 2.84x one stream's for 4 / 8 /
# 16 streams, about 0.003-0.006 a row past 16 besides the streams' own work, so 0.008 prices long drafts somewhat
# high: docs/performance.md, "Batched DFlash with the 64-row tiles"; with 16-row tiles the H200's steps of 32-256
# rows cost 0.031 a row); on a CPU a multi-row
# product costs 1.5x + 0.034x per row more (the demo pair on the 2-core development machine: a 2-row target pass
# 1.57x a 1-row one, 16 rows 2.0-2.2x).

# A batched step's work per stream besides the weights (sampling and acceptance, each sequence's attention and
# cache-write rows, the host's bookkeeping), in one-row target passes, by device: the demo pair's batched steps on the
# 2-core machine cost 2.97 plain batched steps a drafting step at 4 streams and 3.26 at 8 (measured tau over the
# measured speedup, docs/adaptive.md), which the weights alone put at 3.19 and 4.69; 0.1 puts them at 2.76 and 3.54.
# On the H200, pipelined, one attention launch a layer for all streams: 16 plain streams 6.27 ms a step against
# 4.54 for one, 0.02 of a step a stream past the rows' own cost.
STREAM_OVERHEAD = {"cpu": 0.1, "cuda": 0.02}


def rows_factor(rows: int, device_type: str) -> float:
    if device_type == "cpu":
        return 1.0 if rows <= 1 else 1.5 + 0.034 * rows
    return 1.0 + 0.004 * (min(rows, 16) - 1) + 0.008 * max(0, rows - 16)


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


def estimate_cost(target, drafter, device_type: str, streams: int = 1) -> DraftCost:
    """The cost of drafting steps relative to a plain step, from the weights each pass reads (once, at
    load: no timing). A drafting step of n guesses runs the drafter over its block, the target's LM head over the
    n drafted rows, and the target over n + 1 rows; a plain step runs the target over one row. A mixture of
    experts reads about rows * top_k / num_experts of its experts in a pass (all of them at most). streams: a
    batched step of that many streams, each drafting n, against one of as many plain streams (every pass's rows
    that many times over, and STREAM_OVERHEAD one-row passes a stream on both). Each n's ratio, and (for the
    reports) the line 1 + fixed + per_token * n through n = 1 and n = block - 1."""
    lm, experts, other = weight_bytes(target)
    _, d_experts, d_other = weight_bytes(drafter)
    cfg = target.config
    n_experts, top_k = getattr(cfg, "num_experts", 0) or 0, getattr(cfg, "top_k_experts", 0) or 0
    block = drafter.block_size

    def weights_read(rows: int) -> float:
        share = min(1.0, rows * top_k / n_experts) if n_experts and top_k else 1.0
        return lm + other + experts * share

    def target_pass(rows: int) -> float:
        return rows_factor(rows * streams, device_type) * weights_read(rows * streams)

    overhead = STREAM_OVERHEAD.get(device_type, STREAM_OVERHEAD["cpu"])
    per_streams = overhead * streams * weights_read(1) if streams > 1 else 0.0

    def drafting(n: int) -> float:
        return (target_pass(n + 1) + rows_factor(block * streams, device_type) * (d_other + d_experts)
                + rows_factor(n * streams, device_type) * lm + per_streams)

    plain = target_pass(1) + per_streams
    if plain <= 0:
        return DraftCost()
    last = max(block - 1, 1)
    ratios = (1.0, *(drafting(n) / plain for n in range(1, last + 1)))
    r1, rn = ratios[1], ratios[last]
    per_token = max(0.0, (rn - r1) / (last - 1)) if last > 1 else 0.0
    return DraftCost(fixed=max(0.0, r1 - 1.0 - per_token), per_token=per_token, ratios=ratios)


@dataclass
class GenerationStats:
    """Per-generation statistics, in llama.cpp's names where it has them."""

    prompt_n: int = 0      # prompt tokens run
    cache_n: int = 0       # prompt tokens whose cache rows were reused instead (llama-server's cache_n)
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # steps whose guess at position p was accepted
    draft_lengths: dict[int, int] = field(default_factory=dict)     # draft length -> steps that used it
    context_shifts: int = 0  # times a full context was shifted (stream's context_shift)

    def record_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.draft_n += drafted
        self.draft_n_accepted += accepted
        self.draft_lengths[drafted] = self.draft_lengths.get(drafted, 0) + 1
        if accepted > len(self.accepted_per_position):
            self.accepted_per_position += [0] * (accepted - len(self.accepted_per_position))
        for p in range(accepted):
            self.accepted_per_position[p] += 1

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens committed per decoding step (accepted guesses + 1)."""
        return (self.draft_n_accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.draft_n_accepted / self.draft_n if self.draft_n else None

    @property
    def predicted_per_second(self) -> float:
        return 1000.0 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length: the tokens run and those whose rows came from the cache."""
        return self.prompt_n + self.cache_n

    def timings(self) -> dict:
        """llama-server's `timings` object (draft fields only when drafting ran)."""
        t = {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1000.0 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.predicted_n if self.predicted_n else 0.0,
            "predicted_per_second": self.predicted_per_second,
        }
        if self.draft_n > 0:
            t["draft_n"] = self.draft_n
            t["draft_n_accepted"] = self.draft_n_accepted
        return t

    def to_dict(self) -> dict:
        return {**self.timings(), "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
                "steps": self.steps, "tau": self.tau, "acceptance_rate": self.acceptance_rate,
                "accepted_per_position": list(self.accepted_per_position),
                "draft_lengths": {str(k): v for k, v in sorted(self.draft_lengths.items())}}


@dataclass
class Delta:
    """Newly committed text and token ids (stop strings and incomplete characters held back), and when: the time
    since decoding started (after the prompt), for live speed figures."""

    text: str
    token_ids: list[int]
    predicted_ms: float = 0.0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs


class StepLaunched:
    """A decoding step launched and waiting to run batched with other streams' steps (stream's batch_steps): the
    caller runs SpeculativeDecoder.flush(), then advances the stream, which collects the step (with graphs, where
    the flush only queued it: launches its next step first, yielding this again, and collects the one before)."""


@dataclass
class PromptProgress:
    """After each prefill pass of a prompt (stream's prompt_progress): how many of its positions the caches hold
    so far (processed), of how many (total), how many of them were reused from the caches (cache), and the
    milliseconds since its processing began: llama-server's prompt_progress."""

    processed: int
    total: int
    cache: int
    time_ms: float

    def as_dict(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str   # "stop" (EOS or a stop string) or "length" (max tokens or context full)
    stop_type: str       # llama.cpp's: "eos", "word", "limit"
    stopping_word: str
    seed: int
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for logprobs

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "stop_type": self.stop_type, "seed": self.seed, **self.stats.to_dict()}

    def summary(self) -> str:
        """One line for a log or a terminal: speed, prompt, drafting, how it ended."""
        s = self.stats
        line = (f"{s.predicted_n} tokens in {s.predicted_ms / 1000:.2f} s: {s.predicted_per_second:.1f} tok/s; "
                f"prompt {s.prompt_n} tokens in {s.prompt_ms:.0f} ms")
        if s.draft_n:
            line += (f"; tau {s.tau:.2f}, acceptance {s.draft_n_accepted}/{s.draft_n} "
                     f"({100 * s.acceptance_rate:.1f}%)")
        return line + f"; finish {self.finish_reason} ({self.stop_type}); seed {self.seed}"


class Engine:
    """A loaded target (and optional drafter) that generates, plain or with DFlash, from one code path."""

    def __init__(self, target, tokenizer: Tokenizer | None, drafter=None, context_size: int | None = None,
                 name: str = "model", adaptive: bool = True, cuda_graphs: bool | None = None,
                 compile: bool | None = None, cache_type_k: str | None = None, cache_type_v: str | None = None,
                 draft_cache_type_k: str | None = None, draft_cache_type_v: str | None = None,
                 ngram: NgramSettings | None = None, draft_window: int | None = None,
                 prefill_chunk: int | None = None, pad_prefill: bool | None = None):
        """Over models already built (with their LayerPlan: Engine.load resolves it from the device)."""
        ctx = context_size or target.config.max_position_embeddings
        self.decoder = SpeculativeDecoder(target, drafter, ctx, cuda_graphs, compile,
                                          cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                                          draft_cache_type_k=draft_cache_type_k,
                                          draft_cache_type_v=draft_cache_type_v, ngram=ngram,
                                          draft_window=draft_window,
                                          prefill_chunk=PREFILL_CHUNK if prefill_chunk is None else prefill_chunk,
                                          pad_prefill=pad_prefill)
        self.tokenizer = tokenizer
        self.name = name
        self.eos_ids = set(target.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(tokenizer.eos_token_id))
        self._sequence: Sequence | None = None
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request
        self._grammars_lock = threading.Lock()
        self.adaptive = adaptive  # default policy: the adaptive controller (True) or the full block (False)
        self._default_policy: tuple[bool, DraftPolicy] | None = None  # (adaptive when made, the policy)
        self._prefill_lengths_met = False  # a warm-up has run every bucket's pass length once (warm_up)
        self._draft_costs: dict[int, DraftCost] = {}  # draft_cost's, by streams

    @classmethod
    def load(cls, model: str | Path, drafter: str | Path | None = None, device=None, dtype=None,
             context_size: int | None = None, adaptive: bool = True, gemm: str | None = None,
             attention: str | None = None, cache_type_k: str | None = None, cache_type_v: str | None = None,
             draft_cache_type_k: str | None = None, draft_cache_type_v: str | None = None,
             ngram: NgramSettings | None = None, draft_window: int | None = None,
             prefill_chunk: int | None = None, pad_prefill: bool | None = None, name: str | None = None,
             slots: int = 1) -> "Engine":
        """Load a target (and optional drafter) from model folders; the context defaults to min(8192, the model's).
        gemm: "cublas" or "triton" (batch-invariant skinny GEMM for decode/verify/draft, CUDA only);
        attention: "sdpa" or "triton" (batch-invariant split-KV attention for the same passes). None (default):
        "triton" for both on CUDA when Triton is installed, else "cublas" and "sdpa". cache_type_k / _v and
        draft_cache_type_k / _v: KV cache types of the target's and the drafter's caches (f32, f16, bf16, q8_0,
        q5_1, q5_0, q4_1, q4_0; None: the model's dtype). ngram: draft by n-gram lookup in the sequence itself
        (engine.ngram), with no drafter model. draft_window: the drafter sees only the last N committed tokens
        (--spec-dflash-cross-ctx; None: all of them). prefill_chunk: a prompt runs in passes of at most this many
        tokens (-ub/--ubatch-size; None: config.PREFILL_CHUNK). pad_prefill: pad each pass to one of a few sizes
        (config.prefill_buckets), which the warm-up runs once; None: on CUDA. name: the model's name in responses
        (None: the loader's, from the folder or the GGUF file). slots: sequences whose steps may run as one
        batched step (a server's -np): the models' few-row passes are built to take all their rows."""
        device, dtype = default_device_dtype(device, dtype)
        block = drafter_block_size(drafter) if drafter else ngram.max_draft + 1 if ngram else 1
        plan = resolve_plan(device, gemm, attention, block_size=block, slots=slots)
        loaded = load_model(model, drafter, device=device, dtype=dtype, context_size=context_size,
                            overhang=MAX_BLOCK_SIZE, plan=plan)
        name = name or loaded.name
        if context_size and loaded.context_size < context_size:
            log.warning("context size %d was asked for, but %s supports %d tokens: the context is %d",
                        context_size, name, loaded.context_size, loaded.context_size)
        return cls(loaded.target, loaded.tokenizer, loaded.drafter, loaded.context_size, name=name,
                   adaptive=adaptive, cache_type_k=cache_type_k,
                   cache_type_v=cache_type_v, draft_cache_type_k=draft_cache_type_k,
                   draft_cache_type_v=draft_cache_type_v, ngram=ngram, draft_window=draft_window,
                   prefill_chunk=prefill_chunk, pad_prefill=pad_prefill)

    @property
    def context_size(self) -> int:
        return self.decoder.context_size

    @property
    def has_drafter(self) -> bool:
        return self.decoder.drafter is not None

    @property
    def drafts(self) -> bool:
        """Whether generation can draft: with a drafter model, or by n-gram lookup."""
        return self.decoder.drafts

    @property
    def max_draft(self) -> int:
        return self.decoder.max_draft if self.drafts else 0

    def _own_sequence(self) -> Sequence:
        """The sequence of calls that pass none (made on first use)."""
        if self._sequence is None:
            self._sequence = self.new_sequence()
        return self._sequence

    def new_sequence(self, oracle: Oracle | None = None) -> Sequence:
        """A sequence to generate in (generate's and stream's `sequence`); oracle: what replaces its drafter's
        guesses (engine.speculative.Oracle: benchmarks and tests with a chosen acceptance pattern)."""
        return self.decoder.new_sequence(oracle)

    def encode_prompt(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer; pass token ids")
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        if not prompt:
            raise ValueError("prompt is empty")
        return self.tokenizer.encode(prompt)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.context_size:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens, which does not fit the context size "
                             f"{self.context_size} (it needs room for at least one generated token)")
        vocab = self.decoder.target.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary (size {vocab})")

    def check_sampling(self, params: SamplingParams):
        """ValueError naming the problem for sampling parameters this engine cannot honour: invalid values,
        logit_bias token ids outside the vocabulary, a constraint that does not compile. Returns the
        constraint's compiled grammar (None without one); compiled grammars are cached, so a second check of the
        same constraint costs little."""
        params.validate()
        vocab = self.decoder.target.config.vocab_size
        bad = [t for t in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias token id(s) {bad[:5]} outside the vocabulary (size {vocab})")
        return self.compile_constraint(params.constraint) if params.constraint is not None else None

    def compile_constraint(self, constraint: Constraint):
        """The constraint's grammar compiled for this model's tokenizer; ValueError (with the grammar engine's
        message) when it does not compile or the engine cannot constrain output (no tokenizer, no end token)."""
        if self.tokenizer is None:
            raise ValueError(f"a {constraint.kind} constraint needs the model's tokenizer, and this engine has none")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.hf, self.decoder.target.config.vocab_size,
                                                 self.eos_ids)
        return self._grammars.compile(constraint)

    def generate(self, prompt_ids: list[int], params: SamplingParams, draft: int | DraftPolicy | None = None,
                 sequence: Sequence | None = None) -> GenerationResult:
        result = None
        for event in self.stream(prompt_ids, params, draft, sequence):
            if isinstance(event, GenerationResult):
                result = event
        return result

    def warm_up(self, sequence: Sequence | None = None, sampling: list[SamplingParams] = ()) -> float | None:
        """Run what the loop makes or meets on first use, so that the first request finds it done: llama-server's
        warm-up at load. Where prefill passes are padded to buckets, one prompt of each bucket's size that fits the
        context (each pass length's first use of its kernels, met once per engine, and the short passes' CUDA
        graphs, made per sequence); with CUDA graphs or compiled layers, a short generation over a made-up prompt:
        plain and full-block steps, greedy and with each of `sampling`'s settings (graphs are kept per sequence and
        per warping settings). sequence: the one to warm (graphs are its own), None for the engine's own, which
        generate and stream use when given none. It is left empty, as new. Returns the seconds it took, or None
        where nothing is made on first use (no buckets, no graphs, no compiled layers: a CPU by default, where it
        would only add to the load time)."""
        decoder = self.decoder
        steps = decoder.graphs is not None or decoder.compiled
        if not steps and not decoder.prefill_buckets:
            return None
        started = time.perf_counter()
        sequence = sequence if sequence is not None else self._own_sequence()
        for size in decoder.prefill_buckets:  # a length's first use once per engine; graphs once per sequence
            if size < self.context_size and (decoder.graphs_prefill(size) or not self._prefill_lengths_met):
                decoder.prefill(sequence, self._made_up_prompt(size), SamplingParams(), seed=0, capture_graphs=True)
        if decoder.compiles and not self._prefill_lengths_met:
            self._warm_up_passes_over_a_prefix(sequence)
        self._prefill_lengths_met = True
        if steps:
            self._warm_up_steps(sequence, sampling)
        sequence.tokens = []
        return time.perf_counter() - started

    def _warm_up_passes_over_a_prefix(self, sequence: Sequence) -> None:
        """Eager prefill passes over cached rows (a chat's next turn, a long prompt's later passes), of two sizes
        longer than the fused path's rows: compiled layers trace more keys than queries on first use, and dynamo
        traced that case for one pass length first, then again for any length (seen with torch 2.13 on the CPU).
        On the H200 a first 6000-token turn took 3.1 s instead of 0.3 (docs/performance.md). The warm-up's other
        passes all start at position 0."""
        decoder = self.decoder
        sizes = [size for size in decoder.prefill_buckets if size > decoder.plan.max_rows] or [decoder.prefill_chunk]
        long = next((size for size in sizes if not decoder.graphs_prefill(size)), sizes[-1])
        short = next((size for size in sizes if size != long), long // 2)  # no buckets: half a full pass
        prompt = self._made_up_prompt(2 * long + short)
        if len(prompt) >= self.context_size:
            return
        for end in (long, 2 * long, len(prompt)):  # the first from position 0, then each over the one before
            decoder.prefill(sequence, prompt[:end], SamplingParams(), seed=0, reuse=end > long)

    def _made_up_prompt(self, length: int) -> list[int]:
        vocab = self.decoder.target.config.vocab_size
        return [1 + i % (vocab - 1) for i in range(length)]

    def _warm_up_steps(self, sequence: Sequence, sampling: list[SamplingParams]) -> None:
        """warm_up's generations: the steps' graphs and compiled layers, for each sampling setting and draft."""
        prompt = self._made_up_prompt(max(1, min(32, self.context_size // 2)))
        tokens = min(2 * self.decoder.block_size + 2, self.context_size - len(prompt))
        drafts = (0, self.max_draft) if self.drafts else (0,)
        for params in [SamplingParams(), *sampling]:
            params = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    min_p=params.min_p, seed=0, max_tokens=max(1, tokens), ignore_eos=True)
            for draft in drafts:
                self.generate(prompt, params, draft, sequence=sequence)

    def draft_cost(self, streams: int = 1) -> DraftCost:
        """estimate_cost of this engine's pair for `streams` streams stepping together (made once per count)."""
        cost = self._draft_costs.get(streams)
        if cost is None:
            d = self.decoder
            cost = self._draft_costs[streams] = estimate_cost(d.target, d.drafter, d.device.type, streams)
        return cost

    def make_policy(self) -> DraftPolicy:
        """A new default draft-length policy, for a new slot (keep it for the slot's requests: it learns across
        them): the adaptive controller priced for this engine's pair and device, or the full block."""
        if self.has_drafter and self.adaptive:
            return AdaptiveDraft.for_engine(self)
        return FixedDraft(self.max_draft)

    def default_policy(self) -> DraftPolicy:
        """The policy of requests that pass no draft: made once and kept, so that what the adaptive controller
        learnt of the acceptance carries over. One policy for all such requests: concurrent generations (a
        server's slots) should each pass their own."""
        if self._default_policy is None or self._default_policy[0] != self.adaptive:
            self._default_policy = (self.adaptive, self.make_policy())
        return self._default_policy[1]

    def stream(self, prompt_ids: list[int], params: SamplingParams, draft: int | DraftPolicy | None = None,
               sequence: Sequence | None = None, n_min: int = 0, n_max: int | None = None,
               reuse_prefix: bool = False, context_shift: bool = False, n_keep: int = 0,
               prompt_progress: bool = False,
               batch_steps: bool | Callable[[], bool] = False
               ) -> Iterator[Delta | PromptProgress | StepLaunched | GenerationResult]:
        """Yield Delta events as tokens are committed, then one GenerationResult.

        draft: None = the engine's default policy (kept across requests: default_policy), an int = that fixed
        length (0 = plain decoding), or a DraftPolicy. n_max caps the draft length of this request; a length
        below n_min drafts nothing (as llama-server's speculative.n_max / n_min). reuse_prefix: run only the
        part of the prompt past the longest prefix the sequence's caches already hold (llama-server's
        cache_prompt; stats.cache_n says how many tokens were reused). context_shift (llama-server's
        --context-shift): when the context is full, keep the prompt's first n_keep tokens (-1: all of the prompt),
        drop half of the tokens after them and go on (the kept tokens run again at their new positions), instead
        of finishing with "length"; not with a grammar, whose state the shift would lose. The shift happens at
        the same token count with and without drafting, so greedy DFlash still equals plain decoding.
        prompt_progress: yield a PromptProgress after each prefill pass (-ub tokens at most), so that the caller
        can report it or do other work between passes (a server steps its other slots). batch_steps: where the
        decoder batches steps (SpeculativeDecoder.batches), launch each step deferred and yield StepLaunched
        before collecting it, so that a caller advancing several streams runs their steps as one (flush); a
        function: asked before each launch (a server's lone busy slot keeps its steps pipelined). Closing the
        iterator stops the generation at once, between two prefill passes too.
        """
        grammar = self.check_sampling(params)
        self.check_prompt(prompt_ids)
        if draft is None:
            draft = self.default_policy()
        policy = draft if hasattr(draft, "next_length") else FixedDraft(int(draft))
        cap = self.max_draft if n_max is None else max(0, min(int(n_max), self.max_draft))
        drafting_off = isinstance(policy, FixedDraft) and policy.length == 0
        sequence = sequence if sequence is not None else self._own_sequence()
        seed = resolve_seed(params)
        out = _OutputTracker(self, params)

        t0 = time.perf_counter()
        passes = self.decoder.prefill_passes(sequence, prompt_ids, params, seed, grammar, reuse=reuse_prefix)
        try:
            while True:
                try:
                    processed = next(passes)
                except StopIteration as done:
                    first = done.value
                    break
                if prompt_progress:
                    yield PromptProgress(processed, len(prompt_ids), sequence.reused,
                                         1000 * (time.perf_counter() - t0))
        finally:
            passes.close()
        t1 = time.perf_counter()
        if prompt_progress:
            yield PromptProgress(len(prompt_ids), len(prompt_ids), sequence.reused, 1000 * (t1 - t0))
        stats = GenerationStats(prompt_n=len(prompt_ids) - sequence.reused, cache_n=sequence.reused)
        stats.prompt_ms = 1000 * (t1 - t0)
        delta = out.add(first.committed, first.logprobs)
        # Steps launched and not yet collected. Pipelined decoding keeps one queued behind the one being collected,
        # so the GPU works on the next step while the host handles this one's tokens; otherwise each step runs
        # to the end at launch.
        # A deferred step waits for the others' flush, one at a time (two of a sequence in one batched step would
        # not see each other's tokens); once flushed it is queued on the device like a pipelined step.
        pipelined = self.decoder.pipelines(params)

        def deferring() -> bool:
            return self.decoder.batches and (batch_steps() if callable(batch_steps) else batch_steps)
        # Near the end the next step waits for the queued one, so that it drafts only as far as is really left.
        longest = min(policy.length, cap) if isinstance(policy, FixedDraft) else cap
        queued: deque = deque()

        def drop_queued() -> None:
            """Steps queued and never to be collected are dropped (a deferred one never runs), and so are their
            planned lengths."""
            unplan = getattr(policy, "unplan", None)
            if queued and self.drafts and unplan is not None:
                unplan(len(queued))
            for launched in queued:
                if launched.deferred:
                    self.decoder.withdraw(launched)
            queued.clear()

        last_collect = t1
        try:
            while True:
                if delta is not None:
                    delta.predicted_ms = 1000 * (time.perf_counter() - t1)
                    yield delta
                if out.finished is None and len(sequence.tokens) >= self.context_size:
                    kept = None
                    if context_shift and grammar is None:
                        keep = len(prompt_ids) if n_keep < 0 else min(n_keep, len(prompt_ids))
                        kept = _shifted(sequence.tokens, keep)
                    if kept is None:
                        out.finish("length", "limit")
                    else:
                        # steps queued past the full context are dropped; the kept tokens' next token comes
                        # from their prefill, as it would from the next step
                        drop_queued()
                        log.info("context full (%d tokens): shifted to %d, generation goes on", self.context_size,
                                 len(kept))
                        stats.context_shifts += 1
                        step = self.decoder.prefill(sequence, kept, params, seed, grammar, reuse=True)
                        delta = out.add(step.committed, step.logprobs)
                        continue
                if out.finished is not None:
                    break
                defer = deferring()
                depth = 2 if pipelined else 1
                while len(queued) < depth and not (queued and queued[-1].deferred):
                    # Room for this step's tokens after the most the queued steps can commit: in the cache, and
                    # in what the request has left to generate.
                    room = self.context_size - len(sequence.tokens) - sequence.in_flight - 1
                    max_useful = min(params.max_tokens - len(out.tokens) - sequence.in_flight - 1, room)
                    if queued and max_useful < longest:
                        break
                    # The drafted length is not cut to what the request has left (the output stops at max_tokens,
                    # the guesses past it only verified): a step keeps one of the policy's lengths, whose graph
                    # (a batched step's composition) is captured already, not a new one at every request's end.
                    n = max(0, policy.next_length(min(room, cap))) if self.drafts else 0
                    # n-gram lookup beside a drafter may stand in for it, unless drafting is off for the request
                    lookup_max = 0 if drafting_off else max(0, min(max_useful, cap))
                    queued.append(self.decoder.launch(sequence, 0 if n < n_min else n, lookup_max,
                                                      defer=defer))
                if queued[-1].deferred:
                    yield StepLaunched()
                    if len(queued) < depth and not queued[-1].deferred and queued[-1].error is None:
                        # flushed and queued on the device (graphs): the next step goes in behind it before the
                        # one before is collected, as pipelined steps do
                        delta = None
                        continue
                launched = queued.popleft()
                step = self.decoder.collect(sequence, launched)
                # A step's time: measured on the device when it ran pipelined (other slots' steps and the host's
                # work do not count), else from its launch to its end.
                now = time.perf_counter()
                seconds = step.seconds if step.seconds is not None else now - max(launched.launched_at, last_collect)
                # a lookup's guesses beside a drafter teach the draft policy nothing of the drafter's
                looked_up_instead = step.looked_up and self.has_drafter
                policy.record(0 if looked_up_instead else step.drafted, 0 if looked_up_instead else step.accepted,
                              seconds)
                last_collect = now
                # The timings count a step past the request's end (its guesses beyond max_tokens verified, not
                # output) as the step cut to the tokens the request had left, as if it had drafted only those.
                drafted = min(step.drafted, max(0, params.max_tokens - len(out.tokens) - 1))
                stats.record_step(drafted, min(step.accepted, drafted))
                delta = out.add(step.committed, step.logprobs)
        finally:
            drop_queued()  # steps queued past the end, or the stream was closed
        stats.predicted_n = len(out.tokens)
        stats.predicted_ms = 1000 * (time.perf_counter() - t1)
        finish_reason, stop_type = out.finished
        yield GenerationResult(text=out.text, tokens=list(out.tokens), finish_reason=finish_reason,
                               stop_type=stop_type, stopping_word=out.stopping_word, seed=seed, stats=stats,
                               logprobs=list(out.logprobs) if out.logprobs is not None else None)


def _shifted(tokens: list[int], keep: int) -> list[int] | None:
    """llama-server's context shift: the first `keep` tokens, then those after them less the older half; None
    when there is nothing to drop."""
    discard = (len(tokens) - keep) // 2
    if discard < 1:
        return None
    return tokens[:keep] + tokens[keep + discard:]


class _OutputTracker:
    """Applies EOS, max-token and stop-string rules to committed tokens and releases text that is final, with
    the tokens' logprobs when the request asked for them (kept alongside the tokens, cut where they are cut)."""

    def __init__(self, engine: Engine, params: SamplingParams):
        self.tokenizer = engine.tokenizer
        self.detok = IncrementalText(engine.tokenizer.decode) if engine.tokenizer is not None else None
        self.eos_ids = set() if params.ignore_eos else engine.eos_ids
        self.max_tokens = params.max_tokens
        self.stops = [s for s in params.stop if s]
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.emitted = 0  # characters of text already released
        self.tokens_emitted = 0
        self.finished: tuple[str, str] | None = None
        self.stopping_word = ""

    def finish(self, reason: str, stop_type: str) -> None:
        if self.finished is None:
            self.finished = (reason, stop_type)

    def add(self, committed: list[int], logprobs: list[TokenLogprob] | None = None) -> Delta | None:
        for i, tok in enumerate(committed):
            if tok in self.eos_ids:
                self.finish("stop", "eos")
                break
            self.tokens.append(tok)
            if self.logprobs is not None:
                self.logprobs.append(logprobs[i])
            if len(self.tokens) >= self.max_tokens:
                self.finish("length", "limit")
                break
        if self.tokenizer is not None:
            self.text = self.detok.text(self.tokens)
            self._apply_stop_strings()
        final = self.finished is not None
        release = len(self.text) if final else len(self.text) - self.holdback
        if not final:
            while release > self.emitted and self.text[release - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                release -= 1
        release = max(release, self.emitted)
        # Token ids are released with their text, so a stop string can never take back a released token.
        k = len(self.tokens)
        if release < len(self.text):
            while k > self.tokens_emitted and self.detok.length_at(self.tokens, k) > release:
                k -= 1
        text, new_tokens = self.text[self.emitted:release], self.tokens[self.tokens_emitted:k]
        logprobs = self.logprobs[self.tokens_emitted:k] if self.logprobs is not None else None
        self.emitted, self.tokens_emitted = release, k
        if not text and not new_tokens:
            return None
        return Delta(text=text, token_ids=new_tokens, logprobs=logprobs)

    def _apply_stop_strings(self) -> None:
        if not self.stops:
            return
        search_from = max(0, self.emitted - self.holdback)
        hits = [(self.text.find(s, search_from), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        cut, word = min(hits)
        self.text = self.text[:cut]
        # Keep only the tokens whose text lies wholly before the stop string.
        while self.tokens and self.detok.length_at(self.tokens, len(self.tokens)) > cut:
            self.tokens.pop()
            if self.logprobs is not None:
                self.logprobs.pop()
        self.stopping_word = word
        self.finished = ("stop", "word")
