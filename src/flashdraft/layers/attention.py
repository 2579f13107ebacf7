import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias

from flashdraft.config import ModelConfig
from flashdraft.layers import decode_attention as attention_kernel
from flashdraft.layers.decode_attention import decode_attention, decode_attention_segments
from flashdraft.layers.elementwise import RMSNorm, rope
from flashdraft.layers.plan import LayerPlan
from flashdraft.layers.qkv_prep import qkv_prep, qkv_prep_segments
from flashdraft.layers.skinny_gemm import Linear, attach_fused, skinny_linear
from flashdraft.quant.kv_formats import read_rows, write_rows


# SDPA's kernels for the passes longer than decode_attention takes (prefill): not cuDNN's, which builds an execution
# plan for every new shape (about 100 ms for each new prompt length on the H200, 2026-12-03: docs/performance.md).
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | CausalBias | None, scale: float | None = None) -> torch.Tensor:
    """SDPA of q [b, heads, Tq, hd] over k/v [b, kv_heads, Tk, hd] (grouped query heads: head h reads kv head
    h // (heads // kv_heads)), mask None, boolean (broadcastable to [b, 1, Tq, Tk]) or a CausalBias (causal from
    the lower right: no mask tensor where SDPA's flash kernel takes the call, grouped heads as they are; else the
    boolean mask of it).

    With a mask, SDPA's `enable_gqa` falls back on CUDA to its math kernel, which materialises every score in
    float32. Folding each group's query heads into the query length instead ([b, kv_heads, group * Tq, hd],
    the mask tiled to match) asks the same of a plain multi-head call that the fused kernels take, and copies
    no key or value. scale: SDPA's (None: 1 / sqrt(hd))."""
    with sdpa_kernel(PREFILL_SDPA):
        return _grouped_attention(q, k, v, mask, scale)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | CausalBias | None,
                       scale: float | None) -> torch.Tensor:
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if isinstance(mask, CausalBias) and heads != kv_heads \
            and not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True)):
        # only SDPA's flash kernel takes a causal bias with grouped heads as it is (head_dim <= 256, half precision,
        # CUDA): elsewhere SDPA would build the mask and take its math kernel, so the mask is built here and folded.
        # The bias asks the question as SDPA's dispatch of it does, is_causal False: with True, flash refuses every
        # pass whose query and key lengths differ (an upper-left causal one), which was every prefill pass over a
        # cache (docs/performance.md)
        Tq, Tk = q.shape[-2], k.shape[-2]
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    if heads == kv_heads:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask is None or isinstance(mask, CausalBias):
        # enable_gqa a literal: compiled with dynamic shapes, `heads != kv_heads` is symbolic, which SDPA refuses
        # (dynamo broke every compiled layer's graph there: docs/performance.md)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, group, Tq, hd = q.shape[0], heads // kv_heads, q.shape[-2], q.shape[-1]
    if mask.dim() == 4 and mask.shape[1] != 1:
        raise ValueError(f"grouped_attention takes a mask shared by the heads, got shape {list(mask.shape)}")
    mask = mask.reshape(-1, 1, *mask.shape[-2:]) if mask.dim() >= 3 else mask
    if mask.shape[-2] > 1:  # folded query row g * Tq + t is query t of the group's head g
        mask = mask.repeat(*[1] * (mask.dim() - 2), group, 1)
    folded = F.scaled_dot_product_attention(q.reshape(b, kv_heads, group * Tq, hd), k, v, attn_mask=mask, scale=scale)
    return folded.reshape(b, heads, Tq, hd)  # fused kernels may return [b, Tq, heads, hd] strides


class AttentionSegment(NamedTuple):
    """One sequence's part of a batched pass: its rows (consecutive in the pass), one layer's cache of it, their
    positions, the cache rows attended ([0, kv_len)) and the mask [rows, kv_len]."""

    rows: int
    cache_k: torch.Tensor
    cache_v: torch.Tensor
    positions: torch.Tensor
    kv_len: int
    mask: torch.Tensor | None


class MergedSegments(NamedTuple):
    """A batched pass's segments as one launch of each attention kernel per layer reads them (made once a pass,
    by merge_segments): every row's cache row (positions) and mask [R, kv_len] over the longest of the segments'
    kv_len (a row's bits do not depend on how far past its last visible key a pass reads: decode_attention), the
    segment table (segment_table: each segment's first row, rows and caches' offsets from the first's) and each
    row's caches' offsets, and the segments' row counts."""

    positions: torch.Tensor
    mask: torch.Tensor
    kv_len: int
    table: torch.Tensor
    offsets: torch.Tensor
    rows: tuple[int, ...]


def segment_table(rows: list[int], keys: list[list[torch.Tensor]],
                  values: list[list[torch.Tensor]]) -> torch.Tensor | None:
    """The int64 table one launch of qkv_prep and decode_attention over several sequences' caches reads (a batched
    pass's; a CUDA graph keeps it as a constant made outside capture): per segment its first row, its
    rows, and the element offsets of its keys' and values' cache from the first segment's, then per row those
    offsets again ([S * 4 + R * 2], on the caches' device). keys / values: each segment's cache tensors, one per
    layer. None where one launch cannot serve them: caches of other shapes, strides or dtypes than the first's, or
    offsets that differ between layers or are not a multiple of 16 elements (the kernels' loads keep their
    alignment)."""
    k0, v0 = keys[0], values[0]
    spec = [(t.shape, t.stride(), t.dtype) for t in (k0[0], v0[0])]
    segments, per_row, first = [], [], 0
    for n, k, v in zip(rows, keys, values):
        if [(t.shape, t.stride(), t.dtype) for t in (k[0], v[0])] != spec:
            return None
        offsets = []
        for mine, base in ((k, k0), (v, v0)):
            size = base[0].element_size()
            gaps = {mine[i].data_ptr() - base[i].data_ptr() for i in (0, -1)}
            if len(gaps) > 1 or next(iter(gaps)) % (16 * size):
                return None
            offsets.append(next(iter(gaps)) // size)
        segments += [first, n, *offsets]
        per_row += offsets * n
        first += n
    table = torch.tensor(segments + per_row, dtype=torch.int64)
    if k0[0].device.type != "cuda":
        return table.to(k0[0].device)
    # from pinned memory without waiting: a plain copy would wait for the device's queued work (the round before,
    # which a pipelined batched step runs while the host prepares the next)
    return table.pin_memory().to(k0[0].device, non_blocking=True)


def merge_segments(segments: list[AttentionSegment], table: torch.Tensor) -> MergedSegments:
    """The MergedSegments of one pass's segments (their mask None: every row up to its kv_len visible) and their
    segment_table."""
    kv_len = max(s.kv_len for s in segments)
    masks = []
    for s in segments:
        m = _rows_mask(s.mask)
        if m is None:
            m = torch.ones(1, s.kv_len, dtype=torch.bool, device=s.positions.device)
        if m.shape[1] < kv_len:  # a shorter segment's rows see nothing past its own kv_len
            m = F.pad(m, (0, kv_len - m.shape[1]), value=False)
        masks.append(m.expand(s.rows, -1))
    S = len(segments)
    return MergedSegments(torch.cat([s.positions for s in segments]), torch.cat(masks), kv_len,
                          table[:4 * S].view(S, 4), table[4 * S:].view(-1, 2), tuple(s.rows for s in segments))


def _rows_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask shared by the heads (broadcastable to [1, 1, T, kv_len]) as decode_attention takes it:
    [T or 1, kv_len]."""
    if mask is None or mask.dim() == 2:
        return mask
    if math.prod(mask.shape[:-2]) != 1:
        raise ValueError(f"decode_attention takes one mask shared by the heads, got shape {list(mask.shape)}")
    return mask.reshape(mask.shape[-2:])


class Attention(nn.Module):
    """GQA attention whose keys and values live in a preallocated cache ([kv_heads, capacity, row] per layer, rows
    of any KV cache type: flashdraft.quant.kv_formats).

    New keys/values are written (quantized, for a quantized cache) at their absolute positions before attention
    reads the first kv_len rows, so a token reads the same values whether it was written by this call or an earlier
    one.
    Rows past a query's position are stale (rolled back) or not yet written, and the mask hides them,
    which is what makes rollback free.
    """

    def __init__(self, cfg: ModelConfig, plan: LayerPlan = LayerPlan(), context_projection: bool = False):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # a DFlash drafter's: k/v_proj also project context rows (no input norm), so they keep weights of their own
        self.context_projection = context_projection
        # cached passes of up to this many tokens run decode_attention (where it takes the head size)
        self.attention_rows = plan.attention_rows if attention_kernel.supports(self.head_dim) else 0
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(h, self.n_heads * self.head_dim, bias=bias, max_rows=plan.gemm_rows)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, bias=bias, max_rows=plan.gemm_rows)
        self.v_proj = Linear(h, self.n_kv * self.head_dim, bias=bias, max_rows=plan.gemm_rows)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=bias, max_rows=plan.gemm_rows)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj = None  # q, k and v as one projection, once fuse_projections() found them alike
        self.qk_proj = None  # else q and k as one, where they are alike

    def fuse_projections(self) -> None:
        """q, k and v as one projection (fuse_rows: float, or GGUF blocks of one type): one GEMM per step instead
        of three; the q/k/v_proj weights become views of its own, so no memory is added and the other paths keep
        working. Where v is of another type (Q4_K_M files hold a Q6_K attn_v in half the layers), q and k as one.
        Done once."""
        if self.qkv_proj is None and self.qk_proj is None:
            attach_fused(self, "qkv_proj", [self.q_proj, self.k_proj, self.v_proj])
            if self.qkv_proj is None:
                attach_fused(self, "qk_proj", [self.q_proj, self.k_proj])

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_proj is not None:
            return *self.qk_proj(x).split([q_size, kv_size], dim=-1), self.v_proj(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _rotated(self, x: torch.Tensor, heads: int, norm: RMSNorm | None, cos, sin) -> torch.Tensor:
        """[..., T, heads * head_dim] -> [..., heads, T, head_dim], per-head normed (Qwen3) and rotated."""
        x = x.unflatten(-1, (heads, self.head_dim))
        if norm is not None:
            x = norm(x)
        return rope(x.transpose(-3, -2), cos.unsqueeze(-3), sin.unsqueeze(-3))

    def _value_heads(self, v: torch.Tensor) -> torch.Tensor:
        return v.unflatten(-1, (self.n_kv, self.head_dim)).transpose(-3, -2)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values for rows x: [..., T, hidden] -> two [..., kv_heads, T, head_dim]
        (cos/sin: [..., T, head_dim], or [T, head_dim] shared by a batch)."""
        return self._rotated(self.k_proj(x), self.n_kv, self.k_norm, cos, sin), self._value_heads(self.v_proj(x))

    def forward(self, x, cos, sin, cache_k, cache_v, positions, kv_len: int, mask: torch.Tensor | None):
        q, k, v = self._heads(x, cos, sin)
        return self.o_proj(self._attend(q, k, v, cache_k, cache_v, positions, kv_len, mask))

    def segments_forward(self, x, cos, sin, segments: list[AttentionSegment]) -> torch.Tensor:
        """attention(x) for the rows of several sequences in one pass (a batched step), x holding each segment's
        rows in turn: the projections over all rows, each sequence's keys and values written to its own cache and
        its queries attending over that cache alone."""
        q, k, v = self._heads(x, cos, sin)
        out, at = [], 0
        for s in segments:
            rows = slice(at, at + s.rows)
            out.append(self._attend(q[:, rows], k[:, rows], v[:, rows], s.cache_k, s.cache_v, s.positions, s.kv_len,
                                    s.mask))
            at += s.rows
        return self.o_proj(torch.cat(out))

    def _heads(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (normed, rotated) and values of rows x [T, hidden], each [heads, T, head_dim]."""
        q, k, v = self._qkv(x)
        return (self._rotated(q, self.n_heads, self.q_norm, cos, sin),
                self._rotated(k, self.n_kv, self.k_norm, cos, sin), self._value_heads(v))

    def _attend(self, q, k, v, cache_k, cache_v, positions, kv_len: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Write k, v at their positions in the cache, then attend q [heads, T, head_dim] over its first kv_len rows:
        [T, heads * head_dim]."""
        T = q.shape[1]
        write_rows(cache_k, positions, k)
        write_rows(cache_v, positions, v)
        if T <= self.attention_rows:  # the kernel reads every cache type itself
            return decode_attention(q, cache_k[:, :kv_len], cache_v[:, :kv_len], _rows_mask(mask))
        keys = read_rows(cache_k[:, :kv_len], self.head_dim, q.dtype)
        values = read_rows(cache_v[:, :kv_len], self.head_dim, q.dtype)
        out = grouped_attention(q[None], keys[None], values[None], mask)
        return out[0].transpose(0, 1).reshape(T, self.n_heads * self.head_dim)

    def prepped_forward(self, x, cos, sin, segments: list[AttentionSegment],
                        merged: MergedSegments | None = None) -> torch.Tensor:
        """attention(x) for a few-row cached pass of normed rows x (one sequence's, or several sequences' rows in
        turn, each segment over its own cache): the q/k/v products over all rows (one where they are fused), per
        segment qkv_prep (q/k norm, RoPE, cache writes: one kernel) and decode_attention, o_proj over all rows
        (DecoderLayer.quant_forward)."""
        if self.qkv_proj is not None:
            qkv, v = self.qkv_proj(x), None
        elif self.qk_proj is not None:  # v of another type: its product read apart, not copied beside q|k
            qkv, v = self.qk_proj(x), self.v_proj(x)
        else:
            qkv, v = torch.cat(self._qkv(x), dim=-1), None
        return self.o_proj(self._prepped_attention(qkv, cos, sin, segments, merged, v))

    def fused_forward(self, h, norm_eps: float, cos, sin, segments: list[AttentionSegment],
                      merged: MergedSegments | None = None) -> torch.Tensor:
        """h + attention(rms_norm(h)) for a few-row cached pass (one sequence's, or several sequences' rows in
        turn) in 2 + 2 x segments kernels, or 4 with merged (DecoderLayer.fused_forward): the q/k/v GEMM over all
        rows with the input norm (its weight folded into the q/k/v weight), per segment qkv_prep and
        decode_attention over its cache (_prepped_attention), o_proj over all rows with the residual add in its
        epilogue. Needs fused q/k/v weights. Every kernel computes a row from that row (and its own cache) alone,
        so a row's bits do not depend on the other segments."""
        qkv = skinny_linear(h, self.qkv_proj.weight, self.qkv_proj.bias, rms_norm_eps=norm_eps)
        return skinny_linear(self._prepped_attention(qkv, cos, sin, segments, merged), self.o_proj.weight,
                             self.o_proj.bias, residual=h)

    def _prepped_attention(self, qkv: torch.Tensor, cos, sin, segments: list[AttentionSegment],
                           merged: MergedSegments | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """Each segment's rows of the q/k/v projection (v: the value heads' own product, qkv then q|k) through
        qkv_prep into its cache and decode_attention over it: [rows, heads * head_dim], the segments' rows in
        turn. merged (several segments): one launch of each kernel for all of them, each segment's programs doing
        what its own launches would (where the caches are of the compute dtype: the kernel writes no other)."""
        first = segments[0]
        if merged is not None and first.cache_k.dtype == qkv.dtype and first.cache_v.dtype == qkv.dtype:
            q = qkv_prep_segments(qkv, cos, sin, merged.positions, first.cache_k, first.cache_v, merged.offsets,
                                  self.n_heads, self.n_kv, *self._head_norms(), v=v)
            return decode_attention_segments(q.transpose(0, 1), first.cache_k[:, :merged.kv_len],
                                             first.cache_v[:, :merged.kv_len], merged.mask, merged.table,
                                             merged.rows)
        out, at = [], 0
        for s in segments:
            rows = slice(at, at + s.rows)
            q = self._prep_into_cache(qkv[rows], cos[rows], sin[rows], s.positions, s.cache_k, s.cache_v,
                                      self.n_heads, *self._head_norms(), v=None if v is None else v[rows])
            out.append(decode_attention(q.transpose(0, 1), s.cache_k[:, :s.kv_len], s.cache_v[:, :s.kv_len],
                                        _rows_mask(s.mask)))
            at += s.rows
        return out[0] if len(out) == 1 else torch.cat(out)

    def write_context_kv(self, kv: torch.Tensor, cos, sin, positions, cache_k, cache_v) -> None:
        """Keys (k_norm, RoPE) and values of context rows into the cache, from their fused [k; v] projection kv
        [T, 2 * kv_heads * head_dim]: qkv_prep with no query heads (a drafter's fused context path)."""
        _, k_norm, eps = self._head_norms()
        self._prep_into_cache(kv, cos, sin, positions, cache_k, cache_v, 0, k_norm, k_norm, eps)

    def _prep_into_cache(self, qkv: torch.Tensor, cos, sin, positions, cache_k, cache_v, n_heads: int,
                         q_norm_weight, k_norm_weight, eps: float, v: torch.Tensor | None = None) -> torch.Tensor:
        """qkv_prep with its keys and values stored in the cache's types. The kernel writes rows of the compute
        dtype and of the block types (uint8); a float cache of another dtype gets them through rows of their own
        and write_rows."""
        if cache_k.dtype in (qkv.dtype, torch.uint8) and cache_v.dtype in (qkv.dtype, torch.uint8):
            return qkv_prep(qkv, cos, sin, positions, cache_k, cache_v, n_heads, self.n_kv, q_norm_weight,
                            k_norm_weight, eps, v=v)
        T = qkv.shape[0]
        keys, values = (qkv.new_empty((self.n_kv, T, self.head_dim)) for _ in range(2))
        q = qkv_prep(qkv, cos, sin, torch.arange(T, device=qkv.device), keys, values, n_heads, self.n_kv,
                     q_norm_weight, k_norm_weight, eps, v=v)
        write_rows(cache_k, positions, keys)
        write_rows(cache_v, positions, values)
        return q

    def _head_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """qkv_prep's per-head norm arguments: the q_norm and k_norm weights (None without them) and their eps."""
        if self.q_norm is None:
            return None, None, 1e-6
        return self.q_norm.weight, self.k_norm.weight, self.k_norm.eps

    # Cache-free batched path (drafter training, batched data generation): x is [b, T, hidden] and cos/sin are
    # [b, T, head_dim] (or [T, head_dim] shared by the batch); keys and values come from project_kv.

    def batched_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries (normed, rotated) for rows x: [b, T, hidden] -> [b, heads, T, head_dim]."""
        return self._rotated(self.q_proj(x), self.n_heads, self.q_norm, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [b, heads, Tq, hd] over k/v [b, kv_heads, Tk, hd] under a boolean mask broadcastable to
        [b, heads, Tq, Tk] (True = may attend; every query row needs one True), then o_proj: -> [b, Tq, hidden]."""
        out = grouped_attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).flatten(-2))
