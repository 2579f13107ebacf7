"""The DFlash loop: draft a block in one drafter pass, verify it in one target pass, accept, roll back.

Positions: the sequence's committed tokens are tokens[0..L-1]. The target cache holds rows 0..L-2 (the last
committed token has not been run yet); the drafter cache holds projected context for rows below
`draft_len` and `pending` keeps the target taps of rows draft_len..L-2 that are not projected yet.
A step with draft length n runs the drafter on [tokens[L-1], mask x (B-1)] at positions L-1..L+B-2, takes its
greedy guesses for the first n slots, verifies [tokens[L-1], guess_1..guess_n] in one target pass and keeps the
longest prefix of guesses that equal the target's own samples, plus the target's next sample. Cache rows past
the new length are stale and masked by position, so rollback costs nothing. n = 0 is plain decoding on the
same path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashdraft.config import SamplingParams
from flashdraft.engine.cuda_graphs import GraphCache, bucket, compile_layers, fuse_projections
from flashdraft.engine.kv_cache import KVCache
from flashdraft.engine.sampling import sample_tokens
from flashdraft.layers.decode_attention import ATTENTION_BACKENDS, route_attention
from flashdraft.layers.skinny_gemm import BLOCK_M, GEMM_BACKENDS, can_run, route_linears, triton_available
from flashdraft.models import DecoderLM, DFlashDrafter

# Taps waiting for projection are flushed into the drafter cache at this many rows even while drafting is off,
# so a long stretch of plain decoding keeps bounded memory; one batched projection costs little.
MAX_PENDING_ROWS = 256


def _fast_path_default(device: torch.device, fallback: str) -> str:
    """"triton" on a CUDA device that Triton's bf16 tensor-core products run on (compute capability 8.0 and up,
    where the kernels were measured) when Triton is installed, else the fallback."""
    if device.type != "cuda" or not triton_available():
        return fallback
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
        return fallback
    return "triton"


def _resolve_backend(option: str, value: str | None, choices: tuple[str, ...], fallback: str,
                     device: torch.device) -> str:
    value = value or _fast_path_default(device, fallback)
    if value not in choices:
        raise ValueError(f"unknown {option} backend {value!r}; choose from {', '.join(choices)}")
    if value == "triton" and not can_run(device):
        raise ValueError(f"{option}='triton' needs Triton and a CUDA device (got {device.type}"
                         f"{'' if triton_available() else ', and Triton is not installed'})")
    return value


def resolve_gemm(gemm: str | None, device: torch.device) -> str:
    """The GEMM backend for the linear layers: "cublas" or "triton", which needs Triton and a CUDA device (or
    Triton's interpreter, TRITON_INTERPRET=1, as the CPU tests use). None: "triton" on CUDA where Triton is
    installed (faster at batch 1-16 and batch-invariant, docs/performance.md), else "cublas"."""
    return _resolve_backend("gemm", gemm, GEMM_BACKENDS, "cublas", device)


def resolve_attention(attention: str | None, device: torch.device) -> str:
    """The attention backend of passes of up to 16 tokens over the cache: "sdpa" or "triton"
    (flashdraft.layers.decode_attention: split-KV and batch-invariant), which needs what gemm="triton" needs.
    None: "triton" on CUDA where Triton is installed (2-3x faster than SDPA there), else "sdpa"."""
    return _resolve_backend("attention", attention, ATTENTION_BACKENDS, "sdpa", device)


def accept(verify: torch.Tensor, samples: torch.Tensor, n: int) -> torch.Tensor:
    """[accepted, samples...]: how many of the n guesses verify[1..n] equal the target's samples before them (the
    longest matching prefix), then the n + 1 samples. Graph-safe: the step's one host copy reads this vector."""
    accepted = torch.cumprod((verify[1:n + 1] == samples[:n]).long(), 0).sum().view(1)
    return torch.cat([accepted, samples])


@dataclass
class Sequence:
    """One generation's state: its tokens and caches. Reused across requests by re-prefilling."""

    target_cache: KVCache
    draft_cache: KVCache | None
    tokens: list[int] = field(default_factory=list)
    draft_len: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    seed: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    # The last committed token on the device, with the token count it belongs to: the next step reads it from
    # there instead of copying it up from the host (a synchronous copy before every step's first launch).
    last: tuple[int, torch.Tensor] | None = None


@dataclass
class StepResult:
    committed: list[int]  # accepted guesses then the target's own token
    drafted: int           # guesses proposed (n)
    accepted: int          # guesses accepted


class SpeculativeDecoder:
    """Target plus optional drafter over static caches of `capacity` rows (context limit = capacity)."""

    def __init__(self, target: DecoderLM, drafter: DFlashDrafter | None, context_size: int,
                 cuda_graphs: bool | None = None, compile: bool | None = None, gemm: str | None = None,
                 attention: str | None = None):
        self.target, self.drafter = target, drafter
        self.context_size = context_size
        self.block_size = drafter.block_size if drafter is not None else 1
        # The verify block may run up to block_size rows past the last committed position.
        self.capacity = context_size + self.block_size
        self.tap_ids = drafter.config.target_layer_ids if drafter is not None else None
        self.device = target.model.norm.weight.device  # a float parameter even when weights are quantized
        # Optional replacement of the drafter's guesses (benchmarks with a chosen acceptance pattern): called
        # as oracle(start, guesses) after the drafter has run, so the drafter's cost stays real.
        self.oracle = None
        # Decode, verify and draft passes replayed as CUDA graphs (default on CUDA); prefill stays eager.
        # On CUDA by default, also fused projections and compiled layers (docs/performance.md measures each).
        on_cuda = self.device.type == "cuda"
        self.graphs = GraphCache() if (on_cuda if cuda_graphs is None else cuda_graphs) else None
        self._ctx_taps = None
        self._mask_tail = None  # the drafter block's B - 1 mask tokens, on the device
        # gemm: "cublas" (F.linear) or "triton" (flashdraft.layers.skinny_gemm: batch-invariant GEMMs, so the
        # linear layers give a verify step's rows bitwise what plain decoding gets; inputs of more than
        # max(16, block) rows, such as prefill, stay on F.linear). None: resolve_gemm's default.
        self.gemm = resolve_gemm(gemm, self.device)
        models = [m for m in (target, drafter) if m is not None]
        self.compiled = on_cuda if compile is None else compile
        if self.compiled:
            fuse_projections(*models)
        route_linears(*models, gemm=self.gemm, max_m=max(BLOCK_M, self.block_size))
        # attention: "sdpa" or "triton" (decode_attention for passes of up to max(16, block) tokens: decode,
        # verify, draft, and prefills that short; longer prefills stay on SDPA). None: resolve_attention's default.
        self.attention = resolve_attention(attention, self.device)
        route_attention(*models, on=self.attention == "triton", max_t=max(BLOCK_M, self.block_size))
        if self.compiled:
            compile_layers(*models)

    @property
    def max_draft(self) -> int:
        return self.block_size - 1

    def new_sequence(self) -> Sequence:
        return Sequence(target_cache=self.target.new_cache(self.capacity),
                        draft_cache=self.drafter.new_cache(self.capacity) if self.drafter is not None else None)

    def _positions(self, start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count, device=self.device)

    @torch.inference_mode()
    def prefill(self, seq: Sequence, prompt: list[int], params: SamplingParams, seed: int) -> int:
        """Run the prompt and sample the first new token; returns it (already appended to seq.tokens)."""
        seq.tokens, seq.draft_len, seq.pending = list(prompt), 0, []
        seq.params, seq.seed = params, seed
        P = len(prompt)
        tokens = torch.tensor(prompt, device=self.device)
        logits, taps = self.target(tokens, self._positions(0, P), seq.target_cache, P, self.tap_ids, last_only=True)
        sampled = sample_tokens(logits, params, seed, self._positions(P, 1))
        first = int(sampled[0])
        if taps is not None:
            seq.pending.append(taps)
        seq.tokens.append(first)
        seq.last = (len(seq.tokens), sampled[:1])
        return first

    def _last_token(self, seq: Sequence) -> torch.Tensor:
        """[1] on the device: the last committed token."""
        if seq.last is not None and seq.last[0] == len(seq.tokens):
            return seq.last[1]
        return torch.tensor([seq.tokens[-1]], device=self.device)

    def _flush_context(self, seq: Sequence) -> None:
        if not seq.pending:
            return
        taps = torch.cat(seq.pending) if len(seq.pending) > 1 else seq.pending[0]
        self.drafter.add_context(taps, self._positions(seq.draft_len, taps.shape[0]), seq.draft_cache)
        seq.draft_len += taps.shape[0]
        seq.pending = []

    def _draft(self, seq: Sequence, n: int) -> torch.Tensor:
        """The drafter's greedy guesses for the n tokens after the last committed one ([n] on the device)."""
        start, B = len(seq.tokens) - 1, self.block_size
        if self._mask_tail is None:
            self._mask_tail = torch.full((B - 1,), self.drafter.config.mask_token_id, device=self.device)
        block = torch.cat([self._last_token(seq), self._mask_tail])
        if self.graphs is None:
            self._flush_context(seq)
            hidden = self.drafter(self.target.embed(block), self._positions(start, B), seq.draft_cache, start + B)
            guesses = self.target.logits(hidden[1:n + 1]).argmax(dim=-1)
        else:
            guesses = self._draft_graphed(seq, block, start)[:n]
        return self.oracle(start, guesses) if self.oracle is not None else guesses

    def _draft_graphed(self, seq: Sequence, block: torch.Tensor, start: int) -> torch.Tensor:
        """Context projection and the block pass as one graph. Up to B pending context rows go in with the
        block, padded to B rows; the padding lands on the block's own positions, which the block pass then
        overwrites. More pending rows (after prefill or plain decoding) are projected eagerly first."""
        B = self.block_size
        if sum(t.shape[0] for t in seq.pending) > B:
            self._flush_context(seq)
        if self._ctx_taps is None:  # one staging buffer for the graph's input; stale rows are padding
            self._ctx_taps = torch.zeros(B, len(self.tap_ids) * self.target.config.hidden_size, device=self.device,
                                         dtype=self.drafter.norm.weight.dtype)
        taps = self._ctx_taps
        rows = 0
        for t in seq.pending:
            taps[rows:rows + t.shape[0]] = t
            rows += t.shape[0]
        seq.pending, seq.draft_len = [], seq.draft_len + rows
        kv_len = bucket(start + B, self.capacity)
        cache = seq.draft_cache

        def draft_pass(ctx_taps, ctx_positions, block, block_positions):
            self.drafter.add_context(ctx_taps, ctx_positions, cache)
            mask = torch.arange(kv_len, device=block.device)[None, :] <= block_positions[-1:, None]
            hidden = self.drafter(self.target.embed(block), block_positions, cache, kv_len, mask)
            return self.target.logits(hidden[1:]).argmax(dim=-1)

        return self.graphs.run(("draft", id(cache), kv_len), draft_pass, ctx_taps=taps,
                               ctx_positions=self._positions(start - rows, B), block=block,
                               block_positions=self._positions(start, B))

    def _verify(self, seq: Sequence, tokens: torch.Tensor, start: int):
        """Target pass over tokens at positions start..: logits and taps."""
        T = tokens.shape[0]
        if self.graphs is None:
            return self.target(tokens, self._positions(start, T), seq.target_cache, start + T, self.tap_ids)
        kv_len = bucket(start + T, self.capacity)
        cache = seq.target_cache

        def target_pass(tokens, positions):
            return self.target(tokens, positions, cache, kv_len, self.tap_ids)

        return self.graphs.run(("target", id(cache), T, kv_len), target_pass, tokens=tokens,
                               positions=self._positions(start, T))

    def _verify_greedy_graphed(self, seq: Sequence, tokens: torch.Tensor, start: int, n: int):
        """The target pass plus greedy acceptance of the n guesses tokens[1..n] in one graph: taps and
        [accepted, samples 0..n], so that nothing but the one device-to-host copy of that vector follows the
        graph (rows past n + 1 are padding)."""
        T = tokens.shape[0]
        kv_len = bucket(start + T, self.capacity)
        cache = seq.target_cache

        def target_pass(tokens, positions):
            logits, taps = self.target(tokens, positions, cache, kv_len, self.tap_ids)
            return taps, accept(tokens, logits[:n + 1].argmax(dim=-1), n)  # sample_tokens' greedy rule

        return self.graphs.run(("target-greedy", id(cache), T, kv_len, n), target_pass, tokens=tokens,
                               positions=self._positions(start, T))

    @torch.inference_mode()
    def step(self, seq: Sequence, n: int) -> StepResult:
        """One decoding step with up to n drafted tokens (0 = plain decoding)."""
        n = max(0, min(n, self.max_draft)) if self.drafter is not None else 0
        start = len(seq.tokens) - 1
        last = self._last_token(seq)
        verify = torch.cat([last, self._draft(seq, n)]) if n > 0 else last
        if n == 0 and self.drafter is not None and (self.compiled or self.graphs is not None):
            # On the GPU path a plain step runs as two rows, the second a throwaway at the next position (its cache
            # row is the next step's to overwrite). torch.compile gives a one-row pass kernels of its own, which
            # need not round as the multi-row pass does; padded, a plain step gives its token the bits a verify
            # step gives it, so greedy DFlash stays equal to plain decoding. At batch 1 a row costs nothing.
            # Without a drafter there is no verify step to match.
            verify = torch.cat([last, last])
        if self.graphs is not None and seq.params.greedy:
            taps, result = self._verify_greedy_graphed(seq, verify, start, n)
        else:
            logits, taps = self._verify(seq, verify, start)
            logits = logits[:n + 1]
            result = accept(verify, sample_tokens(logits, seq.params, seq.seed, self._positions(start + 1, n + 1)), n)
        # The one host sync of the step: acceptance count and the target's samples together.
        host = result.tolist()
        acc = host[0]
        committed = host[1:acc + 2]  # samples 0..acc-1 equal the accepted guesses; sample acc is the target's own
        seq.tokens.extend(committed)
        # A copy: the graphs share one memory pool, so the next replay of any graph may write over `result`.
        seq.last = (len(seq.tokens), result[acc + 1:acc + 2].clone())
        if taps is not None:
            seq.pending.append(taps[:acc + 1].clone() if self.graphs is not None else taps[:acc + 1])
            if n == 0 and sum(t.shape[0] for t in seq.pending) >= MAX_PENDING_ROWS:
                self._flush_context(seq)
        return StepResult(committed=committed, drafted=n, accepted=acc)
