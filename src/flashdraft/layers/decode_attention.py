"""Batch-invariant split-KV attention for the few query rows of a decode, verify or draft step.

`decode_attention(q, k, v, mask, scale)` attends q [heads, T, head_dim] over the first kv_len rows of one layer's cache,
k / v [kv_heads, kv_len, row] (views of the static cache; rows of any KV cache type, flashdraft.quant.kv_formats:
float rows of any dtype, or packed blocks that the kernel dequantizes as it reads them), under a boolean mask
[T or 1, kv_len] (True = may attend; None = every row visible), scaling scores by `scale` (None: 1/sqrt(head_dim);
Gemma 4 uses 1.0), and returns [T, heads * head_dim], the layout o_proj reads. The Triton
kernel (flashdraft.kernels.attention_triton) splits the keys into fixed ranges, one program per (kv head, tile of
query rows, key range), and the last program of each (kv head, tile) adds the ranges' partial softmaxes in a
fixed order; `config_for` picks the tiling from the head width and the cache's capacity (longer key ranges for
long caches), never from T or kv_len.

Why not SDPA: at T = 1..16 over a short cache, cuDNN's flash kernel costs several times the reading of its keys
and values (docs/performance.md), plus the kernels that turn the boolean mask into its own layout. And a row of a
16-query SDPA call need not round as the same query alone does. Here a
row's arithmetic does not depend on T at all (see the kernel module), so with the skinny GEMM the whole target
pass gives a token the same bits in a decode and in a verify step.

Use: the attention modules of a model built with LayerPlan(attention="triton") send passes of at most the plan's
max_rows tokens here (CUDA, or Triton's interpreter for the CPU tests). The kernel is registered as the custom
op `flashdraft::decode_attention`, opaque to torch.compile and safe inside CUDA graph capture (no host sync; they
allocate only the output and the fp32 partials).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from flashdraft.kernels import programmatic
from flashdraft.kernels.runtime import opaque_op
from flashdraft.quant.kv_formats import FLOAT_FORMATS, KERNEL_FORMATS, stored_format

HEAD_DIMS = (16, 32, 64, 128, 256, 512)  # powers of two (tl.arange), at least tl.dot's 16; 512: Gemma 4's full layers


@dataclass(frozen=True)
class AttentionConfig:
    """One tiling of the kernel. Fixed for the process, never chosen by T or kv_len (batch invariance)."""

    block_q: int = 16    # query rows per program (tokens x group heads, token-major), at least tl.dot's 16
    block_n: int = 64    # keys per inner step
    split: int = 128     # keys per program (a multiple of block_n)
    num_warps: int = 4
    num_stages: int = 2
    pipelined: bool = False  # the key loop as one Triton software-pipelines (num_stages), else unrolled
    tma: bool = False  # keys and values by tensor descriptors (float caches, heads up to 256 wide, one sequence)
    few_row_combine: bool = True  # the last program adds a one-token step's rows eight key ranges at a time
                                  # (attention_triton._combine): the same bits, fewer waits for memory

    @property
    def name(self) -> str:
        return (f"q{self.block_q}n{self.block_n}s{self.split}w{self.num_warps}p{self.num_stages}"
                + ("l" if self.pipelined else "") + ("t" if self.tma else "")
                + ("" if self.few_row_combine else "-chain"))

    def few_rows(self, head_dim: int, group: int) -> int:
        """The rows of a tile that the few-row combine takes (0: none): one token's group of heads, rounded up to a
        power of two, where eight key ranges' partials of them fit in 64 registers a thread (so that the combine
        does not need more registers than the key loop before it); a step of one token fills no more."""
        rows = 1 << (group - 1).bit_length()
        if not self.few_row_combine or rows > self.block_q or rows * head_dim > 256 * self.num_warps:
            return 0
        return rows


# The tilings are the fastest measured by scripts/gpu/attention_run.py on an H200 at T = 1 and 16
# (docs/performance.md: "Split-KV decode attention", "Attention over long caches", "Decode attention with a
# pipelined key loop"). Short caches: one step of 128 keys per program, 8 warps.
CONFIG = AttentionConfig(block_n=128, split=128, num_warps=8)
# Caches of more rows (a 4096-token context's is 4112, a verify block over it): longer key ranges, fewer partials
# for the last program to add, and the key loop pipelined (its next steps' loads in flight while one computes).
# Beyond 24576 rows (32K contexts) a kv head's whole verify block in one 64-row tile, its keys read once for the
# block where 16-row tiles read them four times: 85.2 us a layer at 32K keys and 16 tokens against 125.6, 72.4 at one
# token against 65.7 (an H100, scripts/gpu/attention_run.py --long, 2026-12-05; two stages, so two programs a
# multiprocessor); a short context in such a cache pays for the 64-row tile's arithmetic (20.5 us against 13.7 at
# 512 keys). Where the launch allows (float caches of one type, one sequence), both take their keys and values by
# tensor descriptors (Hopper's copy engine; config_for): the same values, so the same bits, and 22.7 us against 25.8
# at 8K keys and one token, 40.9 against 43.2 for 16 tokens; at 32K the whole-block tile gains 2% at one token and
# nothing at 16 (H100, 2026-12-05; the short-cache tiling gains nothing, so it loads by address).
SHORT_CACHE_ROWS = 6144
LONG_CONFIGS = ((24576, AttentionConfig(block_n=64, split=512, num_warps=4, num_stages=3, pipelined=True)),
                (None, AttentionConfig(block_q=64, block_n=64, split=1024, num_warps=4, num_stages=2,
                                       pipelined=True)))
# Wider heads (256: Gemma 4's sliding layers, whose ring holds at most 1088 rows) keep steps of 64 keys (a 128-key
# step would hold 64 KB of keys and 64 KB of values per program at once), one step a program on 8 warps: 102
# registers and no spill, where two steps on 4 warps took 255 and 72 bytes of stack (sm_90, offline). 6.0 us
# against 9.4 at 32 keys and one token, 17.7 against 17.9 at 1088; 6.5 / 24.1 against 9.6 / 24.6 at 16 tokens, and
# faster at every key count between (an H100, scripts/gpu/attention_run.py --shape gemma-sliding --kv-lens,
# 2026-12-06).
WIDE_HEAD_CONFIG = AttentionConfig(split=64, num_warps=8)
# 512-wide heads (Gemma 4's full layers): steps of 32 keys, so a step's keys and values stay at 32 KB each;
# 128-key ranges up to 24576 cache rows (512-key ones made the decode step at a short context in an 8K cache
# slower), 1024-key ranges pipelined on 4 warps beyond.
WIDEST_HEAD_CONFIG = AttentionConfig(block_n=32, num_warps=8)
WIDEST_LONG_CONFIG = AttentionConfig(block_n=32, split=1024, num_warps=4, num_stages=3, pipelined=True)
WIDEST_SHORT_ROWS = 24576


def config_for(head_dim: int, capacity: int = 0, element_bytes: int = 2,
               descriptors: bool = False) -> AttentionConfig:
    """The tiling for a head width, a cache of `capacity` rows and its element size (all fixed for a cache's life;
    never T or kv_len, so a row's arithmetic is the same in every pass over the same cache). A float32 cache of
    512-wide heads keeps one step's keys and values in shared memory at a time: three stages of them would need
    297 KB, over the H200's 227 (the stages change where loads wait, not the arithmetic). descriptors: the launch
    can take keys and values by tensor descriptors (float caches of one type, one sequence's launch), which the
    long tilings then do: the same bits as their loads by address (a batched pass's launch over the same cache
    loads by address)."""
    if 128 < head_dim <= 256:
        return WIDE_HEAD_CONFIG
    if head_dim > 256:
        if capacity <= WIDEST_SHORT_ROWS:
            return WIDEST_HEAD_CONFIG
        return WIDEST_LONG_CONFIG if element_bytes <= 2 else replace(WIDEST_LONG_CONFIG, num_stages=1)
    if capacity <= SHORT_CACHE_ROWS:
        return CONFIG
    config = next(c for limit, c in LONG_CONFIGS if limit is None or capacity <= limit)
    return replace(config, tma=True) if descriptors else config


@functools.cache
def _kernels():
    from flashdraft.kernels import attention_triton
    return attention_triton


def supports(head_dim: int) -> bool:
    return head_dim in HEAD_DIMS


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           config: AttentionConfig | None = None, scale: float | None = None,
           segments: torch.Tensor | None = None, segment_rows: tuple[int, ...] = ()) -> torch.Tensor:
    """Run the kernel (no custom-op wrapper). q [heads, T, hd]; k, v [kv_heads, kv_len, row] (rows of a KV cache
    type) with unit stride along a row; mask None or bool [T or 1, kv_len]; scale: of the scores (None:
    1/sqrt(hd)). Returns [T, heads * hd] in q's dtype.
    config None = config_for(head_dim, the cache's capacity: k's rows per kv head as allocated, from its strides,
    its element size, whether this launch can take tensor descriptors).
    segments (int64 [S, 4], on q's device) with segment_rows (S row counts): q's rows are S sequences' rows in
    turn, each attending over its own cache, whose keys and values start segments[j, 2] and segments[j, 3]
    elements after k's and v's (the same strides and capacity); segments[j, 0:2] = its first row, its rows; the
    mask [T, kv_len] has every row's own (segment_table). One launch for all: each segment's programs do what a
    launch of its rows alone over its cache does."""
    heads, T, hd = q.shape
    kv_heads, kv_len = k.shape[0], k.shape[1]
    if heads % kv_heads or v.shape[:2] != k.shape[:2] or k.dim() != 3 or v.dim() != 3 or not supports(hd):
        raise ValueError(f"decode_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                         f"(head_dim must be one of {HEAD_DIMS}, heads a multiple of kv_heads)")
    k_format, v_format = stored_format(k, hd), stored_format(v, hd)
    c = config or config_for(hd, k.stride(0) // max(1, k.stride(1)), k.element_size(), descriptors=(
        segments is None and k_format.name in FLOAT_FORMATS and v_format.name == k_format.name))
    if mask is not None and (mask.dim() != 2 or mask.shape[0] not in (1, T) or mask.shape[1] != kv_len):
        raise ValueError(f"decode_attention: mask {list(mask.shape)} is not [{T} or 1, {kv_len}]")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"decode_attention: the mask must be boolean (True = may attend), got {mask.dtype}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention: keys and values need unit stride along head_dim")
    group = heads // kv_heads
    n_segments = len(segment_rows) if segments is not None else 1
    if segments is not None and (segments.shape != (n_segments, 4) or sum(segment_rows) != T
                                 or segments.dtype != torch.int64 or mask is None or mask.shape[0] != T):
        raise ValueError(f"decode_attention: segments {list(segments.shape)} ({segments.dtype}) for rows "
                         f"{list(segment_rows)} of q's {T}, mask {None if mask is None else list(mask.shape)}: "
                         f"want int64 [{n_segments}, 4] and a [{T}, kv_len] mask")
    if c.tma and (k_format.name not in FLOAT_FORMATS or v_format.name != k_format.name or segments is not None
                  or hd > 256):
        raise ValueError(f"decode_attention: tiling {c.name} loads by tensor descriptors: float caches of heads "
                         f"up to 256 wide, one sequence's launch (got {k_format.name} / {v_format.name} rows, "
                         f"head_dim {hd}{', segments' if segments is not None else ''})")
    tiles = -(-(max(segment_rows, default=T) * group) // c.block_q)
    splits = max(1, -(-kv_len // c.split))
    out = torch.empty((T, heads * hd), dtype=q.dtype, device=q.device)
    m = torch.empty((n_segments * kv_heads * tiles * splits * c.block_q,), dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty((m.shape[0], hd), dtype=torch.float32, device=q.device)
    if mask is not None:
        mask = mask.view(torch.uint8)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
    stride_mt = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    keys, values = (_descriptor(k, c.block_n), _descriptor(v, c.block_n)) if c.tma else (k, v)
    kernel = _kernels().attention_kernel
    kernel[(kv_heads, tiles, splits * n_segments)](
        q, keys, values, mask if mask is not None else q, m, l_sum, acc,
        _tickets(q.device, n_segments * kv_heads * tiles), out, segments if segments is not None else q, T,
        kv_len, splits, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), stride_mt,
        out.stride(0), math.log2(math.e) * (1 / math.sqrt(hd) if scale is None else scale), GROUP=group, D=hd,
        HAS_MASK=mask is not None, IEEE=q.dtype == torch.float32, BLOCK_Q=c.block_q, BLOCK_N=c.block_n, SPLIT=c.split,
        K_FMT=KERNEL_FORMATS.get(k_format.name, 0), V_FMT=KERNEL_FORMATS.get(v_format.name, 0),
        K_ALIGN=_row_alignment(k), V_ALIGN=_row_alignment(v), PIPELINED=c.pipelined, SEGMENTED=segments is not None,
        TMA=c.tma, FEW_ROWS=c.few_rows(hd, group), num_warps=c.num_warps, num_stages=c.num_stages,
        **programmatic.triton_options(kernel, q.device))
    return out


def _descriptor(rows: torch.Tensor, block_n: int):
    """A tensor descriptor over the cache view rows [kv heads, kv_len, head_dim] (strides as allocated), read in
    boxes of one head's block_n rows; rows past kv_len read as zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [1, block_n, rows.shape[2]])


def _row_alignment(rows: torch.Tensor) -> int:
    """The largest power of two, at most 16, dividing every row's element offset (the kernel's loads of packed
    rows are that many bytes wide)."""
    g = math.gcd(rows.stride(0), rows.stride(1), 16)
    return g & -g


_TICKETS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """The kernel's per-(kv head, tile) arrival counters: zeros between launches (the last program of each pair
    sets its counter back), one buffer per device shared by every layer and call, kept out of CUDA graph pools so
    that graphs can keep its address. Made (or grown) outside graph capture only: every pass runs eagerly once,
    as a warm-up or a prefill, before its capture."""
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"decode_attention: {count} counters needed during CUDA graph capture; run the pass "
                               "once outside capture first")
        if tickets is not None:
            _RETIRED.append(tickets)  # graphs captured with it still use it
        tickets = _TICKETS[device] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return tickets


def _output_like(q, k, v, mask, scale=None):
    return q.new_empty((q.shape[1], q.shape[0] * q.shape[2]))


@opaque_op("flashdraft::decode_attention", _output_like)
def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    return launch(q, k, v, mask, scale=scale)


def _segments_output_like(q, k, v, mask, segments, segment_rows, scale=None):
    return q.new_empty((q.shape[1], q.shape[0] * q.shape[2]))


@opaque_op("flashdraft::decode_attention_segments", _segments_output_like)
def _decode_attention_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                               segments: torch.Tensor, segment_rows: list[int],
                               scale: float | None = None) -> torch.Tensor:
    return launch(q, k, v, mask, scale=scale, segments=segments, segment_rows=tuple(segment_rows))


def decode_attention_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                              segments: torch.Tensor, segment_rows: list[int],
                              scale: float | None = None) -> torch.Tensor:
    """decode_attention for several sequences' rows in one launch (a batched step's layer): q [heads, R, hd] holds
    the segments' rows in turn, k / v are the first segment's cache (as decode_attention's), the others' caches
    lie segments[j, 2:4] elements from it (segment_table), mask [R, kv_len] is each row's own. Each row gets the
    bits its segment's decode_attention alone gives it."""
    return _decode_attention_segments(q, k, v, mask, segments, list(segment_rows), scale)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None = None) -> torch.Tensor:
    """Attention of q [heads, T, hd] over k, v [kv_heads, kv_len, hd] under mask [T or 1, kv_len] (True = may
    attend; None = all), scores scaled by `scale` (None: 1/sqrt(hd)), -> [T, heads * hd]; each token's row is
    bitwise independent of T (module docstring)."""
    return _decode_attention(q, k, v, mask, scale)
