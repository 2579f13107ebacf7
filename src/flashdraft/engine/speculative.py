"""The DFlash loop: draft a block in one drafter pass, verify it in one target pass, accept, roll back.

Positions: the sequence's committed tokens are tokens[0..L-1]. The target cache holds rows 0..L-2 (the last
committed token has not been run yet). A step with draft length n runs the drafter on [tokens[L-1], mask x (B-1)]
at positions L-1..L+B-2, takes its greedy guesses for the first n slots, verifies [tokens[L-1], guess_1..guess_n]
in one target pass and keeps the longest prefix of guesses that equal the target's own samples, plus the target's
next sample. Cache rows past the new length are stale and masked by position, so rollback costs nothing. n = 0
is plain decoding on the same path.

A sequence's loop state lives on the device (DeviceState): the step's start position, the last committed token,
the seed's key, and the target taps of the last step's committed rows, which the next step projects into the
drafter's cache before it drafts. One step function (`_device_step`: draft -> verify -> sample -> accept ->
advance) reads and advances that state and needs nothing from the host, so it runs eagerly or as one CUDA graph,
greedy or sampled (the noise is keyed by seed and position, below). With graphs, `launch` queues a
step and its result's copy to the host and returns; `collect` waits for it, so the GPU runs step i + 1 while the
host handles step i's tokens. A step launched past the end of a generation only writes cache rows past its
committed length (masked, like rolled-back rows) and is never collected; the next prefill sets the state again.

Logit processing (bias, penalties, a grammar), logprobs and n-gram drafting need the host between the passes
(`_host_step`): the same passes, the guesses chosen or looked up on the host, the verify rows processed there
row i as if guesses[:i] were committed, so acceptance compares the guesses with the samples plain decoding would
have had.

Sampling (logit warping and position-keyed sampling, at the end of this module) is Gumbel-max over the warped
log-probabilities, with the noise a pure function of (seed, absolute position, token id) computed by an integer
hash on the device. Two consequences:
- the token at a position depends only on the logits there and the seed, never on how many tokens were sampled
  before or in which pass, so with the same seed DFlash and plain decoding emit the same text;
- there is no generator state to carry or sync, so a step can be captured in a CUDA graph.

Acceptance is exact match between the drafter's greedy proposal and the target's sample at each slot, cut at the
first mismatch. Every committed token is thus the target's own sample given the committed prefix: the output
follows the target's warped distribution exactly (this is speculative sampling with a one-hot draft distribution,
whose acceptance probability p(x) equals the chance of a match).
"""
from __future__ import annotations

import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from flashdraft.config import PREFILL_CHUNK, SamplingParams, prefill_buckets
from flashdraft.engine.cuda_graphs import GraphCache, bucket
from flashdraft.engine.grammar import GrammarMatcher
from flashdraft.engine.logit_processor import LogitProcessor, TokenLogprob
from flashdraft.engine.model_prep import compile_layers, compiles
from flashdraft.engine.ngram import NgramProposer, NgramSettings
from flashdraft.kernels.runtime import can_run, interpreting
from flashdraft.models.llama.model import DecoderLayer
from flashdraft.models import DecoderLM, DFlashDrafter
from flashdraft.models.kv_cache import HostArena, KVCache, WindowKVCache

# With a grammar, each drafted slot takes the best of the drafter's this many candidates that the grammar allows
# after the slots before it (a draft that ends in a forbidden guess could not be accepted past it).
DRAFT_CANDIDATES = 8

# With both a drafter and n-gram lookup, a step the drafter would draft takes the lookup's proposal instead when
# it is at least this long (a stretch copied from earlier in the text); a step the draft policy leaves plain takes
# any proposal the lookup finds.
LONG_LOOKUP = 8

# Steps that do not run the drafter leave their context rows waiting in the device state for a later projection
# of them all: run eagerly, up to this many (on a CPU one projection of many rows costs less than one per step);
# captured, up to a block (a step's projection has a fixed shape: B rows), so a plain stretch projects once every
# B steps instead of every step (docs/performance.md, "Plain steps with a drafter loaded").
MAX_WAITING_ROWS = 256
# Graphs of batched steps kept (each a composition of the steps it runs: their lengths, the caches they read up to);
# the oldest goes beyond this.
MAX_BATCH_GRAPHS = 64

# Prefill passes padded to a bucket of at most this many rows replay a CUDA graph captured by the warm-up: below it
# an eager pass is bound by the host launching its kernels (a 37-512-token prompt of an 8B took 37-47 ms on the
# H200, its GPU work under 10 ms: docs/performance.md); beyond, the GPU's work takes longer than the launches.
PREFILL_GRAPH_ROWS = 512


def accept(verify: torch.Tensor, samples: torch.Tensor, n: int) -> torch.Tensor:
    """[accepted, samples...]: how many of the n guesses verify[1..n] equal the target's samples before them (the
    longest matching prefix), then the n + 1 samples. Graph-safe: the step's one host copy reads this vector."""
    accepted = torch.cumprod((verify[1:n + 1] == samples[:n]).long(), 0).sum().view(1)
    return torch.cat([accepted, samples])


def shared_prefix(a: list[int], b: list[int], chunk: int = 256) -> int:
    """The length of the prefix two token lists share. Compared a chunk of tokens at a time (list equality runs in
    C), then token by token inside the chunk that differs: a slot's or a kept prefix's tokens are compared with
    every new prompt, and over a long shared prefix (a 10K-token system prompt) a loop token by token took
    milliseconds of the request's time."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + chunk] == b[i:i + chunk]:
        i += chunk
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class DeviceState:
    """A sequence's loop state on the device, read and advanced by each step. Allocated once per sequence, outside
    the graphs' memory pool, so graphs can keep its addresses; set from the host by each prefill."""

    start: torch.Tensor      # [1] int64: position of the last committed token (= len(tokens) - 1)
    last: torch.Tensor       # [1] int64: the last committed token
    key: torch.Tensor        # [2] int64: the request's seed as the sampling noise reads it (sampling.seed_key)
    ctx_taps: torch.Tensor | None  # [rows, taps width]: target taps of rows not yet in the drafter cache (+ padding)
    ctx_rows: torch.Tensor | None  # [1] int64: how many leading rows of ctx_taps are real

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.start, self.last, self.key, self.ctx_taps, self.ctx_rows) if t is not None]


@dataclass
class Launched:
    """A step handed to the device (or, done, one run to the end); collect() turns it into a StepResult."""

    drafted: int
    host: torch.Tensor | None = None        # receives [accepted, samples 0..n] (pinned memory on CUDA)
    event: torch.cuda.Event | None = None   # recorded after that copy
    began: torch.cuda.Event | None = None   # recorded before the step's graph: the step's device time
    done: StepResult | None = None
    launched_at: float = 0.0
    projected: bool = False  # the step projected the context rows waiting before it
    error: Exception | None = None  # why a deferred step's batched run failed (collect raises it)
    batched: bool = False  # run by flush, in a batched step

    @property
    def deferred(self) -> bool:
        """Waiting for SpeculativeDecoder.flush (launch with defer): neither run nor queued on the device."""
        return self.done is None and self.host is None and self.error is None


# Replaces the drafter's guesses (benchmarks and tests with a chosen acceptance pattern): called as
# oracle(start, guesses) after the drafter has run, so the drafter's cost stays real. In a step on the device it
# runs inside the step (and its graph, whose key holds it) with start a device scalar, so it must be capturable (no
# host syncs); the device tensors it changes from step to step, if any, are its `mutable` list (a replayed graph
# must see them as they are).
Oracle = Callable[[int | torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Sequence:
    """One generation's state: its tokens, caches and device state. Reused across requests by re-prefilling."""

    target_cache: KVCache
    draft_cache: KVCache | None
    tokens: list[int] = field(default_factory=list)
    # Positions projected into the drafter's cache, as the host knows: at least those below this (exact after
    # prefill and _flush_context; a collected step's committed rows wait in state.ctx_taps for the next step).
    projected: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    state: DeviceState | None = None
    # The most tokens the launched, not yet collected steps can commit; after a generation, steps launched past
    # its end leave it above 0, and the device state ahead of the tokens, until the next prefill.
    in_flight: int = 0
    # The most context rows the launched steps can have left waiting in state.ctx_taps (the host's bound on
    # state.ctx_rows, which it decides from without reading the device).
    waiting: int = 0
    # Pinned landing places of its launched steps' results, used in turn: a sequence has at most two steps in
    # flight, so a buffer comes round again only after its step was collected. Per sequence, because a server
    # interleaves the steps of several sequences.
    host_buffers: list[torch.Tensor] = field(default_factory=list)
    next_host: int = 0
    # The request's logit processing and logprobs (None when it asks for neither).
    processor: LogitProcessor | None = None
    proposer: NgramProposer | None = None  # n-gram drafting's index of this sequence's tokens
    reused: int = 0  # prompt positions the last prefill found in the caches (prefill's reuse)
    # What replaces the drafter's guesses (Oracle), or None. Given when the sequence is made (new_sequence), not
    # written into the decoder: an oracle is made for one prompt's generations (PlantedOracle plants one reference
    # continuation), and the decoder's other sequences (a server's slots, the warm-up's) draft with the drafter.
    oracle: Oracle | None = None
    # Since the last prefill: steps committed, guesses they proposed and accepted (a server's /slots shows them).
    steps: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class _DeferredStep:
    """A step launched with defer, as flush() runs it: its guesses n, verify rows T, the furthest its last
    committed position can be (start; its passes read the cache up to start + T and, drafting, start + B), whether a
    plain step projects the waiting context rows."""

    seq: Sequence
    n: int
    T: int
    start: int
    project: bool
    launched: Launched


@dataclass
class StepResult:
    committed: list[int]  # accepted guesses then the target's own token
    drafted: int           # guesses proposed (n)
    accepted: int          # guesses accepted
    seconds: float | None = None  # the step's time on the device, where measured (pipelined steps on CUDA)
    logprobs: list[TokenLogprob] | None = None  # one per committed token, when the request asked for logprobs
    looked_up: bool = False  # the guesses came from n-gram lookup (with a drafter loaded: not the drafter's)


class SpeculativeDecoder:
    """Target plus optional drafter over static caches of `capacity` rows (context limit = capacity)."""

    def __init__(self, target: DecoderLM, drafter: DFlashDrafter | None, context_size: int,
                 cuda_graphs: bool | None = None, compile: bool | None = None,
                 cache_type_k: str | None = None, cache_type_v: str | None = None,
                 draft_cache_type_k: str | None = None, draft_cache_type_v: str | None = None,
                 ngram: NgramSettings | None = None, draft_window: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, pad_prefill: bool | None = None):
        if prefill_chunk < 1:
            raise ValueError(f"-ub/--ubatch-size (tokens per prefill pass) must be at least 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        if draft_window is not None and (draft_window < 1 or drafter is None):
            raise ValueError(f"--spec-dflash-cross-ctx limits a drafter's context to its last N tokens: it needs a "
                             f"drafter and N >= 1, got {draft_window}" + ("" if drafter else " without a drafter"))
        # the drafter sees only the last draft_window committed positions (None: all of them)
        self.draft_window = draft_window
        # ngram with a drafter: a step takes the lookup's proposal where it is long (or the drafter is off), the
        # drafter's block elsewhere (launch)
        self.target, self.drafter, self.ngram = target, drafter, ngram
        # KV cache types (flashdraft.quant.kv_formats; None: the model's dtype) of the target's and the drafter's
        # caches; a one-row cache of each fails here on an unknown type or a head size the type cannot take.
        self.cache_types, self.draft_cache_types = (cache_type_k, cache_type_v), (draft_cache_type_k,
                                                                                  draft_cache_type_v)
        target.new_cache(1, *self.cache_types)
        if drafter is not None:
            drafter.new_cache(1, *self.draft_cache_types)
        self.context_size = context_size
        self.block_size = drafter.block_size if drafter is not None else ngram.max_draft + 1 if ngram else 1
        # The verify block may run up to block_size rows past the last committed position.
        self.capacity = context_size + self.block_size
        self.tap_ids = drafter.config.target_layer_ids if drafter is not None else None
        self.device = target.model.norm.weight.device  # a float parameter even when weights are quantized
        # Decode, verify and draft passes replayed as CUDA graphs (default on CUDA), and short prefill passes
        # (_prefill_pass)
        on_cuda = self.device.type == "cuda"
        self.graphs = GraphCache() if (on_cuda if cuda_graphs is None else cuda_graphs) else None
        # The sizes prefill passes are padded to (config.prefill_buckets; default on CUDA, where a new pass length
        # pays its kernels' first use), or none: passes of the prompt's own lengths.
        pads = on_cuda if pad_prefill is None else pad_prefill
        self.prefill_buckets = prefill_buckets(prefill_chunk) if pads else ()
        self._prefill_graph_rows = PREFILL_GRAPH_ROWS  # 0 once a prefill pass could not be captured
        self._mask_tail = None  # the drafter block's B - 1 mask tokens, on the device
        self._guess_buffer = None  # pinned landing place of a step's guesses, for the host's grammar masks
        # The models come built with the plan of their few-row passes (engine.model_prep.resolve_plan); both with
        # the same, whose rows hold a verify block (beyond them the passes are not batch-invariant, and greedy
        # DFlash could part from plain decoding on the GPU).
        self.plan = target.plan
        models = [m for m in (target, drafter) if m is not None]
        if any(m.plan != self.plan for m in models):
            raise ValueError(f"the target and the drafter were built with different plans: {target.plan} and "
                             f"{drafter.plan}")
        if (self.plan.gemm_rows or self.plan.attention_rows) and self.plan.max_rows < self.block_size:
            raise ValueError(f"the models were built for passes of up to {self.plan.max_rows} rows (LayerPlan "
                             f"max_rows), fewer than a verify block of {self.block_size}")
        for m in models:
            m.prepare()
        layers = [[layer for layer in m.modules() if isinstance(layer, DecoderLayer)] for m in models]
        fused = [[layer.fused_rows > 0 for layer in m_layers] for m_layers in layers]
        # every one of the target's layers on the fused path (then plain steps need no padding row)
        self.fused_target = bool(fused[0]) and all(fused[0])
        # On CUDA by default, compiled layers where the fused path is not taken, and the fused layers' module path
        # (prefill) alone; compiles: whether any layer is compiled; compiled: whether steps run compiled layers
        # (docs/performance.md)
        self.compiles = compiles(self.device, compile)
        self.compiled = self.compiles and not all(any(layers) for layers in fused)
        if self.compiles:
            compile_layers(*models)
        # Steps of several sequences can run as one batched step (launch with defer, flush; graphed where graphs
        # are on) where the models take several sequences' rows in one pass (forward_segments) and a row's bits
        # there are those of its sequence's pass alone: every layer on the module path, not compiled (the CPU), or
        # every layer on the fused path of float weights, whose kernels compute each row from that row alone (the
        # GPU). The quantized path's products of more than 16 rows are not batch-invariant (quant.mma_kernels
        # takes up to 16), so GGUF models step one sequence at a time.
        self.few_rows_batched = all(layer.norms_folded for m_layers in layers for layer in m_layers)
        self.batches = (hasattr(target, "forward_segments") and (drafter is None or hasattr(drafter, "forward_segments"))
                        and not self.compiled and (not any(fused[0]) or self.few_rows_batched))
        self._deferred: list[_DeferredStep] = []
        self.batched_tokens = 0  # tokens committed by steps of batched steps, so far (a server's metrics)

    @property
    def max_draft(self) -> int:
        return self.block_size - 1

    @property
    def drafts(self) -> bool:
        """Whether steps can verify guesses: from a drafter model or from n-gram lookup."""
        return self.drafter is not None or self.ngram is not None

    def new_sequence(self, oracle: Oracle | None = None) -> Sequence:
        """A new sequence, its caches of the whole capacity; oracle: what replaces its drafter's guesses
        (Sequence.oracle; None: the drafter's own)."""
        return Sequence(target_cache=self.target.new_cache(self.capacity, *self.cache_types),
                        draft_cache=self.drafter.new_cache(self.capacity, *self.draft_cache_types,
                                                           window=self.draft_window)
                        if self.drafter is not None else None,
                        proposer=self.ngram.proposer() if self.ngram is not None else None, oracle=oracle)

    def _positions(self, start: int | torch.Tensor, count: int) -> torch.Tensor:
        """Positions start..start+count-1 on the device; start an int or a [1] device tensor (a step's state)."""
        return start + torch.arange(count, device=self.device)

    def _state(self, seq: Sequence) -> DeviceState:
        if seq.state is None:
            zeros = lambda n: torch.zeros(n, dtype=torch.long, device=self.device)  # noqa: E731
            ctx = self.drafter is not None
            rows = self._waiting_limit() + self.block_size
            seq.state = DeviceState(
                start=zeros(1), last=zeros(1), key=zeros(2),
                ctx_taps=torch.zeros(rows, len(self.tap_ids) * self.target.config.hidden_size,
                                     device=self.device, dtype=self.drafter.norm.weight.dtype) if ctx else None,
                ctx_rows=zeros(1) if ctx else None)
        return seq.state

    def prefill(self, seq: Sequence, prompt: list[int], params: SamplingParams, seed: int,
                grammar=None, reuse: bool = False, capture_graphs: bool = False) -> StepResult:
        """Run the prompt and sample the first new token (appended to seq.tokens); returns it as a step's result.
        The prompt's context goes into the drafter cache here, and the device state is set for the first step.
        grammar: the compiled grammar of params.constraint (engine.grammar.GrammarCompiler), which it needs.
        reuse: keep the cache rows of the longest prefix the prompt shares with what the sequence holds (a chat's
        earlier turns) and run only the rest; seq.reused says how many. capture_graphs: capture the CUDA graph of
        each pass that can have one and has none (the warm-up at load does; otherwise a pass replays a graph only if
        one was captured, and runs eagerly where none was: a capture takes longer than the pass)."""
        passes = self.prefill_passes(seq, prompt, params, seed, grammar, reuse, capture_graphs)
        while True:
            try:
                next(passes)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()
    def prefill_passes(self, seq: Sequence, prompt: list[int], params: SamplingParams, seed: int,
                       grammar=None, reuse: bool = False,
                       capture_graphs: bool = False) -> Generator[int, None, StepResult]:
        """prefill, pass by pass: yields the prompt positions run so far after each pass of at most prefill_chunk
        tokens but the last, and returns prefill's result, so that a caller can run other work between the passes
        (a server's other slots) or stop (closing it). Between passes the sequence is a consistent one holding
        the prompt's first positions (its tokens the prompt up to one past them): a later prompt may reuse them."""
        if params.constraint is not None and grammar is None:
            raise ValueError("a constrained request needs its compiled grammar")
        reused = self.reusable_rows(seq, prompt) if reuse else 0
        seq.tokens, seq.reused, seq.params, seq.in_flight = list(prompt[:reused + 1]), reused, params, 0
        seq.steps = seq.drafted = seq.accepted = 0
        if self.drafter is not None:  # no context rows wait: the drafter's cache holds the reused positions
            seq.projected, seq.waiting = reused, 0
            if seq.state is not None:
                seq.state.ctx_rows.zero_()
        vocab = self.target.config.vocab_size
        seq.processor = None
        if params.processes_logits or params.logprobs is not None:
            matcher = GrammarMatcher(grammar, vocab, self.block_size + 1) if grammar is not None else None
            seq.processor = LogitProcessor(params, prompt, vocab, self.device, matcher)
        P = len(prompt)
        for begin in range(reused, P, self.prefill_chunk):
            end = min(P, begin + self.prefill_chunk)
            logits, taps = self._prefill_pass(seq, prompt[begin:end], begin, capture_graphs)
            if taps is not None:
                self.drafter.add_context(taps, self._positions(begin, end - begin), seq.draft_cache)
            seq.tokens = list(prompt[:end + 1])
            if self.drafter is not None:
                seq.projected = end
            if end < P:
                yield end
        return self._first_token(seq, prompt, params, seed, logits)

    def _prefill_pass(self, seq: Sequence, tokens: list[int], begin: int,
                      capture: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's pass over a prompt's tokens at positions begin..: the last token's logits, and the tokens'
        taps. Filler rows (the last token repeated, at the positions after it) pad the pass to a bucket where
        _padding allows; what they write lies past the sequence's length, and their logits and taps are dropped.
        A padded pass of at most PREFILL_GRAPH_ROWS rows replays its CUDA graph where one was captured (capture:
        make it if missing): a short pass costs the host more to launch than the GPU to run (docs/performance.md).
        The outputs are then the graph's, valid until a graph replays: the caller uses them at once."""
        real = len(tokens)
        rows = real + self._padding(seq.target_cache, begin + real, real)
        ids = torch.tensor(tokens + tokens[-1:] * (rows - real), device=self.device)
        positions, row = self._positions(begin, rows), torch.tensor([real - 1], device=self.device)
        key = self._prefill_graph_key(seq, begin, rows)
        graphed = None
        if key is not None and (capture or key in self.graphs.graphs):
            kv_len = key[-1]  # rows past a query's position are hidden by position, as in the steps' graphs
            try:
                graphed = self.graphs.run(key, lambda ids, positions, row: self.target(
                    ids, positions, seq.target_cache, kv_len, self.tap_ids, logits_row=row), ids=ids,
                    positions=positions, row=row)
            except RuntimeError as e:
                if not capture:
                    raise
                # a model whose prefill cannot be captured (a host sync in it) prefills eagerly, as before graphs
                warnings.warn(f"flashdraft: a prefill pass of {rows} rows could not be captured as a CUDA graph "
                              f"({type(e).__name__}: {e}); prompts run eagerly", RuntimeWarning, stacklevel=2)
                self._prefill_graph_rows = 0
        logits, taps = graphed or self.target(ids, positions, seq.target_cache, begin + rows, self.tap_ids,
                                               logits_row=row, causal=True)
        return logits, taps[:real] if taps is not None else None

    def graphs_prefill(self, rows: int) -> bool:
        """Whether a prefill pass of `rows` rows can replay a graph (of a sequence's own, captured at its warm-up):
        with graphs, a bucket's size of at most PREFILL_GRAPH_ROWS, while captures have not failed."""
        return self.graphs is not None and rows <= self._prefill_graph_rows and rows in self.prefill_buckets

    def _prefill_graph_key(self, seq: Sequence, begin: int, rows: int) -> tuple | None:
        """The graph key of a prefill pass of `rows` rows from position `begin`, or None where passes run eagerly
        (graphs_prefill). The attention length is rounded up to a KV bucket, so that one graph serves every pass of
        that size reading that many rows."""
        if not self.graphs_prefill(rows):
            return None
        return ("prefill", self.graphs.lifetime_key(seq.target_cache), rows, bucket(begin + rows, self.capacity))

    def _padding(self, cache: KVCache, end: int, rows: int) -> int:
        """How many filler rows pad a prefill pass of `rows` tokens ending before position `end`: up to the smallest
        bucket that holds it, or none when the cache cannot take that many past `end` (its capacity, a ring's
        overhang: filler_rows); a size in between would be as new to the kernels as `rows`."""
        if not self.prefill_buckets:
            return 0
        filler = next(size for size in self.prefill_buckets if size >= rows) - rows
        return filler if filler <= cache.filler_rows(end) else 0

    def _first_token(self, seq: Sequence, prompt: list[int], params: SamplingParams, seed: int,
                     logits: torch.Tensor) -> StepResult:
        """The prefill's sample from the prompt's last logits, and the device state set for the first step."""
        P = len(prompt)
        state = self._state(seq)
        state.key.copy_(seed_key(seed, self.device))
        rows = seq.processor.process(logits, []) if params.processes_logits else logits
        sampled = sample_tokens(rows, params, state.key, self._positions(P, 1))
        state.start.fill_(P)
        state.last.copy_(sampled[:1])
        first = int(sampled[0])
        seq.tokens.append(first)
        logprobs = None
        if seq.processor is not None:
            if params.logprobs is not None:
                logprobs = seq.processor.logprobs(logits, sampled, 1)
            seq.processor.commit([first])
        return StepResult(committed=[first], drafted=0, accepted=0, logprobs=logprobs)

    def reusable_rows(self, seq: Sequence, prompt: list[int]) -> int:
        """How many leading positions of `prompt` the sequence's caches already hold: the tokens it shares with
        the sequence's committed ones whose target rows were run (all but the last), whose drafter context is
        projected, and that each cache still keeps. At least the prompt's last token is left to run, for its
        logits."""
        rows = max(0, min(shared_prefix(seq.tokens, prompt), len(seq.tokens) - 1, len(prompt) - 1))
        if self.drafter is not None and rows > 0:
            if rows > seq.projected:
                self._flush_context(seq)  # rows still waiting belong to tokens the prompt shares
            rows = seq.draft_cache.reusable(min(rows, seq.projected))
        return seq.target_cache.reusable(rows)

    def copy_prefix(self, dst: Sequence, src: Sequence, rows: int) -> None:
        """Give `dst` the caches' first `rows` positions of `src` (at most src's reusable rows for the same
        tokens), so that a prefill of a prompt starting with src.tokens[:rows] reuses them."""
        dst.target_cache.copy_prefix(src.target_cache, rows)
        if self.drafter is not None:
            dst.draft_cache.copy_prefix(src.draft_cache, rows)
        dst.tokens, dst.projected, dst.in_flight = src.tokens[:rows + 1], rows, 0

    def snapshot(self, seq: Sequence, device: torch.device | str | HostArena = "cpu") -> Sequence | None:
        """The positions of seq's caches that a prompt starting with its tokens could reuse, copied to `device` (or
        into a HostArena: ArenaFull when it cannot hold them) as a Sequence that reusable_rows and copy_prefix take
        as a source (the server's PromptCache keeps evicted prefixes so); None when there are none."""
        rows = self.reusable_rows(seq, seq.tokens)
        if rows == 0:
            return None
        return Sequence(target_cache=seq.target_cache.snapshot(rows, device),
                        draft_cache=seq.draft_cache.snapshot(rows, device) if self.drafter is not None else None,
                        tokens=seq.tokens[:rows + 1], projected=rows)

    @torch.inference_mode()
    def _flush_context(self, seq: Sequence) -> None:
        """Project the context rows waiting in the device state into the drafter cache now, after the steps in
        flight (the device's start, which steps launched past a generation's end leave ahead of the tokens: their
        rows of committed positions are right, those past the tokens are never reused)."""
        if seq.state is None:
            return
        self._project_context(seq, exact=True)
        seq.projected, seq.waiting = len(seq.tokens) - 1, 0

    def _clamp(self, n: int) -> int:
        return max(0, min(n, self.max_draft)) if self.drafts else 0

    def _plain_rows(self) -> int:
        """Rows of a plain step's target pass. On the GPU path with a drafter, two: the second a throwaway at the
        next position (its cache row is the next step's to overwrite). torch.compile gives a one-row pass kernels
        of its own, which need not round as the multi-row pass does; padded, a plain step gives its token the bits
        a verify step gives it, so greedy DFlash stays equal to plain decoding. At batch 1 a row costs nothing.
        Without drafting there is no verify step to match, and the fused layer path needs no padding (it is not
        compiled, and its kernels are batch-invariant)."""
        if not self.drafts or self.fused_target:
            return 1
        return 2 if self.compiled or self.graphs is not None else 1

    def pipelines(self, params: SamplingParams) -> bool:
        """Whether steps of this decoding run pipelined (launch before collect): with CUDA graphs and nothing
        for the host to do between verify and acceptance (logit processing) or after it (logprobs); n-gram
        drafting looks its guesses up on the host, so it does not pipeline either."""
        return (self.graphs is not None and self.ngram is None and not params.processes_logits
                and params.logprobs is None)  # n-gram lookup (with a drafter too) reads the tokens on the host

    # -- the passes of a step, each reading and advancing the sequence's device state ---------------------------

    def _project_context(self, seq: Sequence, exact: bool | None = None) -> None:
        """Project the rows waiting in the device state into the drafter cache (_take_waiting; exact: eagerly,
        the default, else captured)."""
        waiting = self._take_waiting(seq, self.graphs is None if exact is None else exact)
        if waiting is not None:
            self.drafter.add_context(*waiting, seq.draft_cache)

    def _take_waiting(self, seq: Sequence, exact: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The context rows waiting in the device state, their taps and positions, taken from it. Exact: only the
        real rows, their count read on the host (None when none wait); else (captured) all B rows, a fixed shape,
        the padding landing on positions from the start on, which the block pass or a later step writes first."""
        state = seq.state
        if exact:
            rows = int(state.ctx_rows)
            taken = (state.ctx_taps[:rows], self._positions(state.start - rows, rows)) if rows else None
        else:
            taken = state.ctx_taps[:self.block_size], self._positions(state.start - state.ctx_rows, self.block_size)
        state.ctx_rows.zero_()
        return taken

    def _waiting_limit(self) -> int:
        """The most context rows left waiting for a projection: what a captured projection takes (B rows), or
        eagerly MAX_WAITING_ROWS."""
        return self.block_size if self.graphs is not None else MAX_WAITING_ROWS

    def _step_projects(self, seq: Sequence, rows: int, drafts: bool) -> bool:
        """Whether a step committing up to `rows` tokens projects the context rows waiting before it: a drafting
        step always (its draft pass does), another when its rows could take them past _waiting_limit(). Notes
        in seq.waiting what the step leaves waiting."""
        if self.drafter is None:
            return False
        projects = drafts or seq.waiting + rows > self._waiting_limit()
        seq.waiting = (0 if projects else seq.waiting) + rows
        return projects

    def _draft_pass(self, seq: Sequence, n: int, kv_len: int, candidates: int = 1) -> torch.Tensor:
        """Project the waiting context rows, run the block: the drafter's greedy guesses for block slots 1..n
        (eagerly; captured, for all B - 1 slots, so one graph serves every n), or with candidates > 1 each slot's
        best candidates, best first."""
        self._project_context(seq)
        block, positions = self._draft_block(seq)
        mask = None if self.graphs is None else self._past_block_mask(seq.draft_cache, kv_len, positions)
        hidden = self.drafter(self.target.embed(block), positions, seq.draft_cache, kv_len, mask)
        return _best(self.target.logits(hidden[1:n + 1] if self.graphs is None else hidden[1:]), candidates)

    def _past_block_mask(self, cache: KVCache, kv_len: int, positions: torch.Tensor) -> torch.Tensor | None:
        """A captured drafter pass reads kv_len rows, a bucket: the mask hiding the rows past the block at these
        positions (None for a window cache, which masks by the positions its rows hold, itself)."""
        if isinstance(cache, WindowKVCache):
            return None
        return torch.arange(kv_len, device=self.device)[None, :] <= positions[-1:, None]

    def _draft_block(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's block after the last committed token (it, then B - 1 mask tokens) and its positions."""
        state = seq.state
        return torch.cat([state.last, self._mask_tail_tokens()]), self._positions(state.start, self.block_size)

    @staticmethod
    def _oracle_guesses(seq: Sequence, guesses: torch.Tensor) -> torch.Tensor:
        """The guesses of a step on the device: its oracle's in the drafter's place, where the sequence has one."""
        return seq.oracle(seq.state.start[0], guesses) if seq.oracle is not None else guesses

    def _accept_step(self, seq: Sequence, tokens: torch.Tensor, samples: torch.Tensor, taps: torch.Tensor | None,
                     n: int) -> torch.Tensor:
        """Accept (see accept) and advance the device state past the committed tokens; their taps wait in it,
        behind any rows still waiting, for a later step's projection. Returns [accepted, samples 0..n]."""
        state = seq.state
        result = accept(tokens, samples, n)
        accepted = result[:1]
        state.last.copy_(result[1:].gather(0, accepted))
        if self.drafter is not None:
            state.ctx_taps.index_copy_(0, self._positions(state.ctx_rows, tokens.shape[0]), taps)
            state.ctx_rows.add_(accepted + 1)
        state.start.add_(accepted + 1)
        return result

    def _device_step(self, seq: Sequence, n: int, T: int, kv_len: int, draft_kv_len: int,
                     project: bool) -> torch.Tensor:
        """One step from the device state alone: draft (n > 0, the sequence's oracle's guesses in their place when
        it has one), or for a plain step project the waiting context rows when `project`; verify T rows, sample,
        accept, advance. Run eagerly, or captured as one graph by launch. Returns [accepted, samples 0..n]."""
        tokens = self._step_tokens(seq, n, T, draft_kv_len, project)
        logits, taps = self.target(tokens, self._positions(seq.state.start, T), seq.target_cache, kv_len,
                                   self.tap_ids)
        return self._finish_step(seq, tokens, logits, taps, n)

    def _step_tokens(self, seq: Sequence, n: int, T: int, draft_kv_len: int, project: bool) -> torch.Tensor:
        """The T tokens a step verifies: the last committed one and the n guesses (drafted now), or for a plain
        step the last one (repeated to T rows), after projecting the waiting context rows when `project`."""
        state = seq.state
        if n > 0:
            return torch.cat([state.last, self._oracle_guesses(seq, self._draft_pass(seq, n, draft_kv_len)[:n])])
        if project:
            self._project_context(seq)
        return state.last.expand(T)

    def _finish_step(self, seq: Sequence, tokens: torch.Tensor, logits: torch.Tensor, taps: torch.Tensor | None,
                     n: int) -> torch.Tensor:
        """Sample the verify rows' logits, accept and advance (_accept_step): [accepted, samples 0..n]."""
        state = seq.state
        samples = sample_tokens(logits[:n + 1], seq.params, state.key, self._positions(state.start + 1, n + 1))
        return self._accept_step(seq, tokens, samples, taps, n)

    @torch.inference_mode()
    def launch(self, seq: Sequence, n: int, lookup_max: int = 0, defer: bool = False) -> Launched:
        """Start one step with up to n drafted tokens. With graphs and nothing for the host to do within the step,
        its graph is queued behind the steps already launched and this returns at once (see the module
        docstring); otherwise the step runs to the end here. lookup_max: with both a drafter and n-gram lookup,
        the most guesses a lookup may propose in the drafter's place (0: none, as in plain decoding). defer: where
        steps batch (`batches`), a step that needs nothing of the host waits for flush(), which runs every
        sequence's waiting step in one batched step (collect flushes too)."""
        n = self._clamp(n)
        began = time.perf_counter()
        lookup = self._lookup(seq, n, self._clamp(lookup_max))
        if seq.processor is not None or lookup is not None or (seq.proposer is not None and self.drafter is None):
            step = self._host_step(seq, n, lookup)
            return Launched(drafted=step.drafted, done=step, launched_at=began)
        T = n + 1 if n > 0 else self._plain_rows()
        project = self._step_projects(seq, n + 1, drafts=n > 0)
        # The start position is known on the device only; graphs are chosen for the furthest it can be (reading
        # more cache rows than needed is harmless: the position mask hides them).
        start_max = len(seq.tokens) - 1 + seq.in_flight
        if defer and self.batches:
            launched = Launched(drafted=n, launched_at=began)
            self._deferred.append(_DeferredStep(seq, n, T, start_max, project, launched))
            return launched
        if self.graphs is None:
            draft_kv_len = seq.draft_cache.kv_len(start_max + self.block_size) if n > 0 else 0
            result = self._device_step(seq, n, T, start_max + T, draft_kv_len, project)
            return Launched(drafted=n, done=self._commit(seq, result.tolist(), n), launched_at=began)
        kv_len = bucket(start_max + T, self.capacity)
        draft_kv_len = seq.draft_cache.kv_len(bucket(start_max + self.block_size, self.capacity)) if n > 0 else 0
        key = ("step", kv_len, draft_kv_len, *self._step_key(seq, n, T, project))
        began_event = self._timing_event()
        result = self.graphs.run(key, lambda: self._device_step(seq, n, T, kv_len, draft_kv_len, project),
                                 mutable=self._mutable(seq))
        host = self._land(seq, result, n)
        return Launched(drafted=n, host=host, event=self._timing_event(), began=began_event, launched_at=began,
                        projected=project)

    def _timing_event(self) -> torch.cuda.Event | None:
        """An event recorded now on the current stream, timing-enabled (a launched step's device time is the span
        between two), on CUDA; else None."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _land(self, seq: Sequence, result: torch.Tensor, n: int) -> torch.Tensor:
        """Queue the copy of a launched step's [accepted, samples 0..n] to the host, into the sequence's next
        landing buffer (pinned on CUDA), and count its tokens in flight. Returns the buffer (valid once an event
        recorded after this has passed)."""
        if not seq.host_buffers:
            seq.host_buffers = [torch.zeros(self.block_size + 1, dtype=torch.long,
                                            pin_memory=self.device.type == "cuda") for _ in range(4)]
        host = seq.host_buffers[seq.next_host]
        seq.next_host = (seq.next_host + 1) % len(seq.host_buffers)
        host[:n + 2].copy_(result, non_blocking=True)
        seq.in_flight += n + 1
        return host

    def _step_key(self, seq: Sequence, n: int, T: int, project: bool) -> tuple:
        """What a graph of a sequence's step is captured for, besides the lengths it reads. GraphCache.lifetime_key:
        a graph replays the cache's and the oracle's tensors' addresses (and the sequence's device state, which
        lives as long as its cache), so their graphs go when they do (an id() alone could come back on a new object
        while the old graph stays)."""
        p = seq.params
        sampling = None if p.greedy else (p.temperature, p.top_k, p.top_p, p.min_p)
        lifetime = self.graphs.lifetime_key
        return lifetime(seq.target_cache), n, T, lifetime(seq.oracle), sampling, project

    @staticmethod
    def _mutable(seq: Sequence) -> list[torch.Tensor]:
        """The device tensors a step of the sequence changes from step to step: its state and its oracle's."""
        return seq.state.tensors() + list(getattr(seq.oracle, "mutable", ()))

    @torch.inference_mode()
    def flush(self) -> int:
        """Run the deferred steps (launch with defer) as batched steps, as many sequences in each as the models'
        few-row passes take (_batches): one drafter pass over the drafting sequences' blocks (_draft_passes), one
        target pass over every sequence's verify rows (forward_segments: each attends over its own cache), each
        one's sampling and acceptance (_batched_step). A sequence's tokens are those of its steps run one by one:
        the same operations on its rows, over more rows at once. With graphs, each batched step is one graph keyed
        by the steps' composition and is queued like a pipelined step (each step's result copied to its
        sequence's host buffer, one event after them): this returns at once, and collect() waits for the event,
        so that the host can launch and flush the next round while the device runs this one. Eagerly the steps
        run to the end here and are committed. A failure is each unfinished step's to raise when collected (the
        requests end, the caller goes on). Returns how many steps it ran or queued."""
        deferred, self._deferred = self._deferred, []
        for steps in self._batches(deferred):
            try:
                for d in steps:
                    d.launched.batched = True
                if self.graphs is None:
                    results = self._run_batched(steps).tolist()
                    at = 0
                    for d in steps:
                        d.launched.done = self._commit(d.seq, results[at:at + d.n + 2], d.n, batched=True)
                        at += d.n + 2
                else:
                    self._queue_batched(steps)
            except Exception as e:  # noqa: BLE001 - each step's own request reports it
                for d in steps:
                    if d.launched.done is None and d.launched.host is None:
                        d.launched.error = e
        return len(deferred)

    def _queue_batched(self, steps: list[_DeferredStep]) -> None:
        """Queue one graphed batched step and each step's result copy to its sequence's host buffer, then one event
        (and one before: the batch's device time, each step's seconds)."""
        began = self._timing_event()
        result = self._run_batched(steps)
        hosts, at = [], 0
        for d in steps:
            hosts.append(self._land(d.seq, result[at:at + d.n + 2], d.n))
            at += d.n + 2
        event = self._timing_event()
        for d, host in zip(steps, hosts):
            d.launched.host, d.launched.event, d.launched.began, d.launched.projected = host, event, began, d.project

    def _batches(self, deferred: list[_DeferredStep]) -> list[list[_DeferredStep]]:
        """The deferred steps in groups (in order) whose passes each fit the models' few-row path (plan.max_rows:
        a drafting step's block, a plain step's rows), where the layers take it: past it a pass would take the module
        path, whose rows need not round as on the few-row path alone. One group on the module path."""
        if not self.few_rows_batched:
            return [deferred] if deferred else []
        groups, rows = [], self.plan.max_rows
        for d in deferred:
            need = self.block_size if d.n > 0 else d.T
            if not groups or rows + need > self.plan.max_rows:
                groups.append([])
                rows = 0
            groups[-1].append(d)
            rows += need
        return groups

    def _run_batched(self, steps: list[_DeferredStep]) -> torch.Tensor:
        """One batched step, eager or graphed: every step's [accepted, samples 0..n], in turn. A graph reads each
        cache up to the furthest step's bucket (rows past a query's position are hidden by its mask) and is keyed
        by the lengths and each step's _step_key; the oldest of more than MAX_BATCH_GRAPHS such graphs goes."""
        if self.graphs is None:
            return self._batched_step(steps)
        kv_len, draft_kv_len = self._batch_reads(steps)
        key = ("batch", kv_len, draft_kv_len, *(part for d in steps for part in self._step_key(d.seq, d.n, d.T,
                                                                                             d.project)))
        result = self.graphs.run(key, lambda **tables: self._batched_step(steps, kv_len, draft_kv_len, **tables),
                                 mutable=[t for d in steps for t in self._mutable(d.seq)],
                                 constants=lambda: self._segment_tables(steps, kv_len, draft_kv_len))
        self.graphs.limit("batch", MAX_BATCH_GRAPHS)
        return result

    def _batch_reads(self, steps: list[_DeferredStep]) -> tuple[int, int]:
        """The cache rows a graphed batched step's target and drafter passes read: the furthest step's buckets."""
        kv_len = bucket(max(d.start + d.T for d in steps), self.capacity)
        draft_kv_len = max((d.seq.draft_cache.kv_len(bucket(d.start + self.block_size, self.capacity))
                            for d in steps if d.n > 0), default=0)
        return kv_len, draft_kv_len

    def _segment_tables(self, steps: list[_DeferredStep], kv_len: int, draft_kv_len: int) -> dict[str, torch.Tensor]:
        """The segment tables of a graphed batched step's target and drafter passes (forward_segments' table: one
        launch of each attention kernel for all sequences), made once, outside capture (their rows are copied from
        the host), as the graph's constants (its key fixes them); none for a pass of one sequence, of caches one
        launch cannot serve, or on the module path (the CPU's), which launches per sequence."""
        tables = {}
        if not self.few_rows_batched:
            return tables
        if len(steps) > 1:
            tables["target_table"] = self.target.segment_table([(d.T, d.seq.target_cache, kv_len) for d in steps])
        drafting = [d for d in steps if d.n > 0]
        if len(drafting) > 1:
            tables["draft_table"] = self.drafter.segment_table([(d.seq.draft_cache, draft_kv_len, None)
                                                                for d in drafting])
        return {name: table for name, table in tables.items() if table is not None}

    def _batched_step(self, steps: list[_DeferredStep], kv_len: int | None = None, draft_kv_len: int | None = None,
                      target_table: torch.Tensor | None = None,
                      draft_table: torch.Tensor | None = None) -> torch.Tensor:
        """_device_step for several sequences at once: the drafting ones' guesses (_draft_passes), the plain ones'
        projections, one target pass over every sequence's verify rows, then each one's sampling and acceptance.
        kv_len, draft_kv_len: the cache rows every sequence's target and drafter passes read (a graph's), or None:
        each its own (eagerly). target_table, draft_table: the passes' segment tables (_segment_tables), or None:
        the passes make their own (eagerly)."""
        drafting = [d for d in steps if d.n > 0]
        guesses = iter(self._draft_passes(drafting, draft_kv_len, draft_table) if drafting else ())  # steps' order
        tokens = [torch.cat([d.seq.state.last, next(guesses)]) if d.n > 0
                  else self._step_tokens(d.seq, d.n, d.T, 0, d.project) for d in steps]
        positions = torch.cat([self._positions(d.seq.state.start, d.T) for d in steps])
        logits, taps = self.target.forward_segments(
            torch.cat(tokens), positions,
            [(d.T, d.seq.target_cache, d.start + d.T if kv_len is None else kv_len) for d in steps],
            self.tap_ids, table=target_table)
        results, at = [], 0
        for d, step_tokens in zip(steps, tokens):
            rows = slice(at, at + d.T)
            results.append(self._finish_step(d.seq, step_tokens, logits[rows], taps[rows] if taps is not None else None,
                                             d.n))
            at += d.T
        return torch.cat(results)

    def _draft_passes(self, steps: list[_DeferredStep], kv_len: int | None = None,
                      table: torch.Tensor | None = None) -> list[torch.Tensor]:
        """_draft_pass for several sequences at once (a batched step's): their waiting context rows projected
        together, their blocks in one drafter pass, the LM head over every block's guess rows (eagerly the n of
        each; in a graph, kv_len given, all B - 1, which the position masks of the longer reads need); then each
        sequence's n guesses (its oracle's in their place, where it has one). table: the block pass's segment
        table (_segment_tables), or None."""
        B, exact = self.block_size, kv_len is None
        waiting = [(*taken, d.seq.draft_cache) for d in steps
                   if (taken := self._take_waiting(d.seq, exact)) is not None]
        if waiting:
            self.drafter.add_context_segments(waiting)
        block, positions = (torch.cat(parts) for parts in zip(*(self._draft_block(d.seq) for d in steps)))
        segments = []
        for j, d in enumerate(steps):
            cache = d.seq.draft_cache
            if exact:
                segments.append((cache, cache.kv_len(d.start + B), None))
            else:
                segments.append((cache, kv_len, self._past_block_mask(cache, kv_len, positions[j * B:(j + 1) * B])))
        hidden = self.drafter.forward_segments(self.target.embed(block), positions, segments, table=table)
        take = [d.n if exact else B - 1 for d in steps]
        best = _best(self.target.logits(torch.cat([hidden[j * B + 1:j * B + 1 + t] for j, t in enumerate(take)])), 1)
        out, at = [], 0
        for d, t in zip(steps, take):
            out.append(self._oracle_guesses(d.seq, best[at:at + d.n]))
            at += t
        return out

    def withdraw(self, launched: Launched) -> None:
        """Forget a deferred step that will not be collected (its stream ended): nothing of it runs."""
        self._deferred = [d for d in self._deferred if d.launched is not launched]

    def collect(self, seq: Sequence, launched: Launched) -> StepResult:
        """Wait for a launched step (in launch order) and commit its tokens (a deferred one: after flush())."""
        if launched.deferred:
            self.flush()
        if launched.error is not None:
            raise launched.error
        if launched.done is not None:
            return launched.done
        if launched.event is not None:
            launched.event.synchronize()
        n = launched.drafted
        seq.in_flight -= n + 1
        if launched.projected:  # the context up to the step's start
            seq.projected = len(seq.tokens) - 1
        seconds = launched.began.elapsed_time(launched.event) / 1000 if launched.began is not None else None
        return self._commit(seq, launched.host[:n + 2].tolist(), n, seconds, launched.batched)

    def _lookup(self, seq: Sequence, n: int, lookup_max: int) -> list[int] | None:
        """The n-gram lookup's guesses for this step, or None for the drafter's (or a plain step): without a
        drafter, up to n tokens; with one, up to lookup_max when the lookup's proposal is LONG_LOOKUP tokens or
        more, or the draft policy has the drafter off (n = 0)."""
        if seq.proposer is None:
            return None
        if self.drafter is None:
            return seq.proposer.propose(seq.tokens, n) if n > 0 else None
        if lookup_max == 0:
            return None
        proposal = seq.proposer.propose(seq.tokens, lookup_max)
        return proposal if proposal and (n == 0 or len(proposal) >= min(LONG_LOOKUP, lookup_max)) else None

    def _commit(self, seq: Sequence, host: list[int], n: int, seconds: float | None = None,
                batched: bool = False) -> StepResult:
        """Commit a step's [accepted, samples 0..n]: the accepted guesses (equal to samples 0..acc-1), then the
        target's own sample acc (counted in batched_tokens for a step of a batched step)."""
        acc = host[0]
        committed = host[1:acc + 2]
        seq.tokens.extend(committed)
        seq.steps, seq.drafted, seq.accepted = seq.steps + 1, seq.drafted + n, seq.accepted + acc
        if batched:
            self.batched_tokens += len(committed)
        return StepResult(committed=committed, drafted=n, accepted=acc, seconds=seconds)

    def _host_step(self, seq: Sequence, n: int, lookup: list[int] | None = None) -> StepResult:
        """One step with the host between the passes: n-gram guesses (lookup), a grammar's guesses chosen from the
        drafter's candidates (a slot with no allowed candidate ends the draft there), the verify rows processed
        (bias, penalties, the grammar's masks, filled on the host while the device runs the verify pass queued
        before), logprobs. The passes are the device step's, graphed where graphs are on."""
        state, params, processor = seq.state, seq.params, seq.processor
        grammar = processor.grammar if processor is not None else None
        start = len(seq.tokens) - 1
        chosen: list[int] | None = None  # guesses known on the host
        guesses = None
        drafted = lookup is None and n > 0 and self.drafter is not None  # the drafter runs, projecting the context
        if lookup is not None:
            chosen = grammar.draft([[g] for g in lookup]) if grammar is not None else lookup
        elif n > 0 and grammar is not None:
            chosen = grammar.draft(self._run_draft(seq, n, start, DRAFT_CANDIDATES).tolist())
        elif n > 0:
            guesses = self._run_draft(seq, n, start)
        fetch = None
        if chosen is not None:
            n = len(chosen)
            guesses = torch.tensor(chosen, dtype=torch.long, device=self.device) if n else None
        elif guesses is not None and params.processes_logits:
            # The host's processing needs the guesses: their copy is queued before the verify pass, which the
            # host's work then overlaps (and taken now, as the verify graph may reuse their memory).
            fetch = self._copy_to_host(guesses)
        tokens = torch.cat([state.last, guesses]) if n > 0 else state.last.expand(self._plain_rows())
        projects = self._step_projects(seq, n + 1, drafts=drafted)
        logits, taps = self.target_pass(seq, tokens, start, project=projects and not drafted)
        logits = logits[:n + 1]
        rows = processor.process(logits, fetch() if fetch else chosen or []) if params.processes_logits else logits
        samples = sample_tokens(rows, params, state.key, self._positions(start + 1, n + 1))
        result = self._accept_step(seq, tokens, samples, taps, n)
        step = self._commit(seq, result.tolist(), n)
        step.looked_up = lookup is not None
        if processor is not None:
            if params.logprobs is not None:
                step.logprobs = processor.logprobs(logits, samples, step.accepted + 1)
            processor.commit(step.committed)
        return step

    def _run_draft(self, seq: Sequence, n: int, start: int, candidates: int = 1) -> torch.Tensor:
        """The drafter's guesses for the n tokens after the last committed one ([n] on the device), or each slot's
        best candidates ([n, candidates]; an oracle's guess is the one candidate of its slot); graphed where graphs
        are on."""
        if self.graphs is None:
            drafted = self._draft_pass(seq, n, seq.draft_cache.kv_len(start + self.block_size), candidates)
        else:
            kv_len = seq.draft_cache.kv_len(bucket(start + self.block_size, self.capacity))
            drafted = self.graphs.run(("draft", self.graphs.lifetime_key(seq.draft_cache), kv_len, candidates),
                                      lambda: self._draft_pass(seq, n, kv_len, candidates),
                                      mutable=seq.state.tensors())[:n]
        if seq.oracle is None:
            return drafted
        return seq.oracle(start, drafted[:, 0])[:, None] if candidates > 1 else seq.oracle(start, drafted)

    @torch.inference_mode()
    def target_pass(self, seq: Sequence, tokens: torch.Tensor, start: int, project: bool = False):
        """The target's pass over tokens at positions start.. (logits and taps; graphed where graphs are on);
        project: first the drafter's waiting context rows. Benchmarks time it alone."""
        T = tokens.shape[0]
        if self.graphs is None:
            if project:
                self._project_context(seq)
            return self.target(tokens, self._positions(start, T), seq.target_cache, start + T, self.tap_ids)
        kv_len = bucket(start + T, self.capacity)

        def target_pass(tokens, positions):
            if project:
                self._project_context(seq)
            return self.target(tokens, positions, seq.target_cache, kv_len, self.tap_ids)

        return self.graphs.run(("target", self.graphs.lifetime_key(seq.target_cache), T, kv_len, project), target_pass,
                               mutable=seq.state.tensors() if project else (), tokens=tokens,
                               positions=self._positions(start, T))

    @torch.inference_mode()
    def draft(self, seq: Sequence, n: int) -> torch.Tensor:
        """The drafter's pass after the last committed token: its n guesses. Benchmarks time it alone (at the
        position of seq.tokens' end, which a benchmark may move by hand: the device state follows)."""
        start = len(seq.tokens) - 1
        seq.state.start.fill_(start)
        return self._run_draft(seq, self._clamp(n), start)

    def _mask_tail_tokens(self) -> torch.Tensor:
        if self._mask_tail is None:
            self._mask_tail = torch.full((self.block_size - 1,), self.drafter.config.mask_token_id, device=self.device)
        return self._mask_tail

    def _copy_to_host(self, tokens: torch.Tensor):
        """Start copying tokens to the host; returns a function that waits for them and gives them as a list.
        On CUDA the copy is queued on the stream, so the work queued after it runs while the host waits."""
        if tokens.device.type != "cuda":
            values = tokens.tolist()
            return lambda: values
        if self._guess_buffer is None:
            self._guess_buffer = torch.zeros(self.block_size, dtype=torch.long, pin_memory=True)
        landed = self._guess_buffer[:tokens.shape[0]]
        landed.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return lambda: done.synchronize() or landed.tolist()


def _best(logits: torch.Tensor, candidates: int) -> torch.Tensor:
    """Each row's argmax ([rows]), or with candidates > 1 its best tokens, best first ([rows, candidates])."""
    return logits.argmax(dim=-1) if candidates == 1 else torch.topk(logits, candidates, dim=-1).indices


# Sampling

_M32 = 0xFFFFFFFF
GUMBEL_BLOCK = 2048  # columns per program of the Gumbel-max kernel (the whole vocabulary: 75 programs a row)
TOP_K_TIES = 16  # candidates past the k-th that top-k keeps when they tie with it (bf16 logits tie often)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (bijective, good avalanche) on int64 tensors holding values < 2**32."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _seed_keys(seed: int) -> tuple[int, int]:
    # splitmix64 of the seed, split into two 32-bit keys.
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z & _M32, z >> 32


def seed_key(seed: int, device: torch.device | str) -> torch.Tensor:
    """The seed as the noise reads it: its two 32-bit keys, [2] int64 on the device. A captured step reads the key
    from this tensor, so one graph serves every seed."""
    return torch.tensor(_seed_keys(seed), dtype=torch.int64, device=device)


def gumbel_noise(key: int | torch.Tensor, positions: torch.Tensor, tokens: int | torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise, float32, keyed by (seed, position, token id); key: the seed, or its seed_key tensor
    (the same noise). tokens: the vocabulary size (noise [T, vocab] for every id) or the ids themselves [T, C]
    (the same values at those ids)."""
    k1, k2 = (key[0], key[1]) if isinstance(key, torch.Tensor) else _seed_keys(key)
    pos_key = _mix32(((positions.long() * 0x9E3779B1) ^ k1) & _M32)[:, None]
    if isinstance(tokens, int):
        tokens = torch.arange(tokens, device=positions.device, dtype=torch.int64)[None, :]
    x = _mix32(_mix32(tokens ^ k2) ^ pos_key)
    x = _mix32(x ^ ((pos_key * 0x27D4EB2F) & _M32))
    return gumbel_from_bits(x)


def gumbel_from_bits(x: torch.Tensor) -> torch.Tensor:
    """Gumbel noise from 32-bit hash values: the top 24 bits as a uniform in (0, 1). In float32 the highest value,
    (2**24 - 0.5) / 2**24, rounds to 1, whose noise is +inf: a token removed by warping or a grammar (-inf)
    would then sample as NaN, which argmax picks. It is clamped to the float just below 1."""
    u = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u.clamp(max=1.0 - 2.0 ** -24)))


def warped_candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, then top-k, top-p, min-p: the log-probabilities of the tokens left, with their ids ([T, C]
    each, removed tokens at -inf), or of the whole vocabulary ([T, V], ids None). With top-k the candidates come
    sorted from one top-k selection, so top-p needs no sort of the vocabulary and the rest of sampling works on
    about k columns instead of V (docs/performance.md, "Sampling on the candidates"). Top-k keeps the tokens tied
    with the k-th (as transformers and vLLM do), up to TOP_K_TIES of them."""
    ids, vocab = None, logits.shape[-1]
    if 0 < params.top_k < vocab:  # the k best logits are the k best log-probabilities
        x, ids = torch.topk(logits, min(params.top_k + TOP_K_TIES, vocab), dim=-1)
        x = x.float() / params.temperature
        x = torch.log_softmax(x.masked_fill(x < x[:, params.top_k - 1:params.top_k], float("-inf")), dim=-1)
    else:
        x = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        if ids is None:
            x, ids = torch.sort(x, dim=-1, descending=True)
        probs = x.exp()
        # Keep the smallest prefix whose mass reaches top_p (a token goes if the mass before it already does),
        # and the tokens tied with its last: which of equal values sorts first must not decide.
        beyond = (probs.cumsum(-1) - probs) >= params.top_p
        last_kept = x.masked_fill(beyond, float("inf")).min(dim=-1, keepdim=True).values
        x = torch.log_softmax(x.masked_fill(x < last_kept, float("-inf")), dim=-1)
    if params.min_p > 0.0:
        threshold = x.max(dim=-1, keepdim=True).values + math.log(params.min_p)
        x = torch.log_softmax(x.masked_fill(x < threshold, float("-inf")), dim=-1)
    return x, ids


def sample_tokens(logits: torch.Tensor, params: SamplingParams, key: int | torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [T, V]; row t is the token at absolute position positions[t]. key: the seed or
    its seed_key tensor. No host syncs: a CUDA graph can capture it."""
    if params.greedy:
        return logits.argmax(dim=-1)
    x, ids = warped_candidates(logits, params)
    return gumbel_max(x, ids, key, positions)


def gumbel_max(x: torch.Tensor, ids: torch.Tensor | None, key: int | torch.Tensor, positions: torch.Tensor,
               kernel: bool | None = None) -> torch.Tensor:
    """The token of each row of warped log-probabilities x [T, C] (token ids `ids` [T, C], or the column when
    None) that has the largest x + gumbel_noise. kernel: one Triton kernel (gumbel_triton, the default where it
    runs on a GPU) or the torch ops that define it."""
    if kernel is None:
        kernel = x.is_cuda and can_run(x.device)
    if not kernel:
        choice = (x + gumbel_noise(key, positions, x.shape[-1] if ids is None else ids)).argmax(dim=-1)
        return choice if ids is None else ids.gather(-1, choice[:, None])[:, 0]
    if not isinstance(key, torch.Tensor):
        key = seed_key(key, x.device)
    T, C = x.shape
    block = min(GUMBEL_BLOCK, max(16, 1 << (C - 1).bit_length()))
    blocks = -(-C // block)
    best_x = torch.empty(T, blocks, device=x.device, dtype=torch.float32)
    best_id = torch.empty(T, blocks, device=x.device, dtype=torch.int64)
    x = x.contiguous()
    ids = ids.contiguous() if ids is not None else None
    _gumbel_kernels().gumbel_max_kernel[(blocks, T)](
        x, ids if ids is not None else best_id, positions.contiguous(), key, best_x, best_id, C, x.stride(0),
        ids.stride(0) if ids is not None else 0, HAS_IDS=ids is not None, BLOCK=block, LIBDEVICE=not interpreting())
    if blocks == 1:
        return best_id[:, 0]
    return best_id.gather(-1, best_x.argmax(dim=-1, keepdim=True))[:, 0]


@functools.cache
def _gumbel_kernels():
    from flashdraft.kernels import gumbel_triton
    return gumbel_triton


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one (reported back so the run can be repeated)."""
    return params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
