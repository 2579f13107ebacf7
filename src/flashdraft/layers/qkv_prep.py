"""Everything between the fused q/k/v GEMM and attention, as one Triton kernel.

`qkv_prep(qkv, cos, sin, positions, cache_k, cache_v, n_heads, n_kv, q_norm_weight, k_norm_weight, eps)` takes a
cached pass's fused projection qkv [T, (n_heads + 2 * n_kv) * head_dim] and
- splits it into query, key and value heads,
- RMS-normalizes each query and key head (Qwen3's q_norm / k_norm; both weights None: no norm),
- applies rotate-half RoPE to them with the pass's cos / sin rows [T, head_dim] (float32, gathered by position),
- writes the keys and the unchanged values into the layer's static cache, cache_k / cache_v [n_kv, capacity,
  row width], at rows positions[t]: rows of qkv's dtype, or of a KV cache block type (-ctk / -ctv: uint8 rows,
  quantized in the kernel byte for byte as kv_formats.quantize does), and
- returns the queries as [T, n_heads, head_dim] (Attention hands q.transpose(0, 1) to decode_attention).
Gemma 4's attention takes it too, with keywords for its own steps: its norms, values normalized or taken from the
keys, a sliding layer's ring rows (qkv_prep's docstring).

Why: compiled, these steps are about four kernels per layer, whose launches cost more than their work. Here they
are one launch of T * (n_heads + n_kv) small programs, one per (token, query head) and per (token, key/value head
pair).

Numerics: `qkv_prep_reference` is what Attention.forward does in eager torch: rms_norm = weight * (x.float() *
rsqrt(mean(x.float()^2) + eps)).to(dtype), rope = x * cos.to(dtype) + rotate_half(x) * sin.to(dtype) in the
tensor dtype. The kernel computes in float32 and rounds to the tensor dtype at every step where that path rounds
(and without FMA contraction), so RoPE is bitwise the eager result, and so are the values (copied). The one
step it cannot reproduce is the float32 mean of squares, whose summation order differs from torch's reduction
(and, on the GPU, whose rsqrt approximation may differ in the last place): the normalized float32 value can
differ by an ulp or so, which in bf16 / fp16 almost never survives the rounding that follows (the CPU tests find
the bf16 and fp16 results bitwise equal) and in float32 leaves differences of a few ulps. A torch.compile'd
Attention is not the eager path either: Inductor by default keeps bf16 intermediates in float32 rather than
rounding each one, so the kernel's bits are the eager path's, not the compiled layer's of today.

Batch invariance: a token's query and cache rows are computed by its own programs from its own qkv, cos, sin and
position, with nothing that depends on T, so they are bitwise the same whether it goes alone or with 15 others.

The kernel is the custom op `flashdraft::qkv_prep` (it mutates cache_k and cache_v), opaque to torch.compile and
safe inside CUDA graph capture: no host sync, and it allocates only q. It runs on CUDA with Triton, or under
Triton's interpreter (TRITON_INTERPRET=1, the CPU tests), where kernels.runtime.can_run says so. Elsewhere
Attention keeps its module-by-module path, which `qkv_prep_reference` reproduces for the tests. A position outside
[0, capacity) writes no cache row (index_copy_ would raise instead; the kernel cannot check without a host sync).
"""
from __future__ import annotations

import functools

import torch

from flashdraft.kernels import programmatic
from flashdraft.kernels.runtime import opaque_op
from flashdraft.layers import elementwise
from flashdraft.quant.kv_formats import KERNEL_FORMATS, KVFormat, stored_format, write_rows

HEAD_DIMS = (16, 32, 64, 128, 256, 512)  # powers of two (one tl.arange spans a head); 512: Gemma 4's full layers


@functools.cache
def _kernels():
    from flashdraft.kernels import qkv_prep_triton
    return qkv_prep_triton


def _checked(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
             cache_k: torch.Tensor, cache_v: torch.Tensor, n_heads: int, n_kv: int,
             q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
             value_is_key: bool = False, v: torch.Tensor | None = None) -> tuple[int, list[KVFormat]]:
    """Check the arguments' shapes, dtypes and devices (shapes only: no host sync); return head_dim and the
    caches' formats (kv_formats: the compute dtype's, or a block type's)."""
    if value_is_key and v is not None:
        raise ValueError("qkv_prep: value_is_key takes the values from the keys; give no v with it")
    kv_in_row = 1 if value_is_key or v is not None else 2
    heads = n_heads + kv_in_row * n_kv
    if qkv.dim() != 2 or n_heads < 0 or n_kv < 1 or qkv.shape[1] % heads:
        raise ValueError(f"qkv_prep: qkv width: qkv {list(qkv.shape)} is not [T, (n_heads + "
                         f"{kv_in_row} * n_kv) * head_dim] with n_heads = {n_heads}, n_kv = {n_kv}")
    T, hd = qkv.shape[0], qkv.shape[1] // heads
    if v is not None and (v.shape != (T, n_kv * hd) or v.dtype != qkv.dtype or v.device != qkv.device):
        raise ValueError(f"qkv_prep: v must be {qkv.dtype} [{T}, {n_kv * hd}] on {qkv.device} (the value heads of "
                         f"qkv's rows), got {v.dtype} {list(v.shape)} on {v.device}")
    if hd not in HEAD_DIMS:
        raise ValueError(f"qkv_prep: head_dim {hd} is not one of {HEAD_DIMS}")
    if cache_k.dim() != 3 or cache_v.dim() != 3 or cache_k.shape[:2] != cache_v.shape[:2] or cache_k.shape[0] != n_kv:
        raise ValueError(f"qkv_prep: cache shapes: cache_k {list(cache_k.shape)} and cache_v {list(cache_v.shape)} "
                         f"must both be [{n_kv}, capacity, row width] (a row of {hd} values)")
    formats = [stored_format(cache, hd) for cache in (cache_k, cache_v)]  # names a row that holds no hd values
    if any(not f.blocked and f.storage != qkv.dtype for f in formats):
        raise ValueError(f"qkv_prep: cache dtypes {cache_k.dtype} / {cache_v.dtype} are neither qkv's {qkv.dtype} "
                         "nor a KV cache block type's (uint8)")
    if cache_k.stride(2) != 1 or cache_v.stride(2) != 1:
        raise ValueError("qkv_prep: the caches need unit stride along head_dim")
    if cos.shape != (T, hd) or sin.shape != (T, hd) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"qkv_prep: cos ({cos.dtype} {list(cos.shape)}) and sin ({sin.dtype} {list(sin.shape)}) "
                         f"must both be float32 [{T}, {hd}]")
    if positions.shape != (T,) or positions.dtype != torch.int64:
        raise ValueError(f"qkv_prep: positions must be int64 [{T}], got {positions.dtype} {list(positions.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("qkv_prep: give both q_norm_weight and k_norm_weight, or neither")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and (weight.shape != (hd,) or weight.dtype != qkv.dtype):
            raise ValueError(f"qkv_prep: {name} is {weight.dtype} {list(weight.shape)}, not {qkv.dtype} [{hd}]")
    tensors = (cos, sin, positions, cache_k, cache_v, q_norm_weight, k_norm_weight)
    if any(x is not None and x.device != qkv.device for x in tensors):
        raise ValueError(f"qkv_prep: every tensor must be on qkv's device, {qkv.device}")
    return hd, formats


def launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           cache_k: torch.Tensor, cache_v: torch.Tensor, n_heads: int, n_kv: int,
           q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
           eps: float = 1e-6, cache_offsets: torch.Tensor | None = None, gemma: bool = False,
           value_is_key: bool = False, wrap: bool = False, v: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel (no custom-op wrapper); arguments and result as qkv_prep (cache_offsets: as
    qkv_prep_segments')."""
    hd, formats = _checked(qkv, cos, sin, positions, cache_k, cache_v, n_heads, n_kv, q_norm_weight, k_norm_weight,
                           value_is_key, v)
    if gemma and q_norm_weight is None:
        raise ValueError("qkv_prep: gemma=True needs the q and k norm weights (Gemma 4 normalizes both)")
    T = qkv.shape[0]
    if cache_offsets is not None and (cache_offsets.shape != (T, 2) or cache_offsets.dtype != torch.int64
                                      or not cache_offsets.is_contiguous()):
        raise ValueError(f"qkv_prep: cache_offsets must be contiguous int64 [{T}, 2], got {cache_offsets.dtype} "
                         f"{list(cache_offsets.shape)}")
    q = torch.empty((T, n_heads, hd), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    # read-only inputs are only made contiguous where a row is not (a row stride larger than the width is fine)
    qkv, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (qkv, cos, sin))
    if v is not None and v.stride(-1) != 1:
        v = v.contiguous()
    has_norm = q_norm_weight is not None
    if has_norm:
        q_norm_weight, k_norm_weight = q_norm_weight.contiguous(), k_norm_weight.contiguous()
    kernel = _kernels().qkv_prep_kernel
    kernel[(T, n_heads + n_kv)](
        qkv, cos, sin, positions, q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        q if n_heads else qkv,  # no query heads: nothing is stored there (an empty tensor may have no address)
        cache_k, cache_v, cache_offsets if cache_offsets is not None else positions, v if v is not None else qkv,
        qkv.stride(0), cos.stride(0), sin.stride(0), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0),
        cache_v.stride(1), v.stride(0) if v is not None else 0, cache_k.shape[1], eps, N_HEADS=n_heads, N_KV=n_kv,
        D=hd, HAS_NORM=has_norm, EMULATE=qkv.device.type != "cuda", HAS_OFFSETS=cache_offsets is not None,
        GEMMA=gemma, V_IS_K=value_is_key, WRAP=wrap, K_FMT=KERNEL_FORMATS.get(formats[0].name, 0),
        V_FMT=KERNEL_FORMATS.get(formats[1].name, 0), V_APART=v is not None, num_warps=1,
        enable_fp_fusion=False,  # no FMA: the eager path rounds the RoPE products before adding them
        **programmatic.triton_options(kernel, qkv.device))
    return q


def _queries_like(qkv, cos, sin, positions, cache_k, cache_v, n_heads, n_kv, q_norm_weight, k_norm_weight, eps,
                  gemma=False, value_is_key=False, wrap=False, v=None):
    """q's shape from qkv's alone: under dynamic shapes a cache's row width is symbolic, and naming its format
    (_checked) would look that up in a table; the real call checks every argument."""
    hd = qkv.shape[1] // (n_heads + (1 if value_is_key or v is not None else 2) * n_kv)
    return qkv.new_empty((qkv.shape[0], n_heads, hd))


@opaque_op("flashdraft::qkv_prep", _queries_like, mutates_args=("cache_k", "cache_v"))
def _qkv_prep(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              cache_k: torch.Tensor, cache_v: torch.Tensor, n_heads: int, n_kv: int,
              q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
              gemma: bool = False, value_is_key: bool = False, wrap: bool = False,
              v: torch.Tensor | None = None) -> torch.Tensor:
    return launch(qkv, cos, sin, positions, cache_k, cache_v, n_heads, n_kv, q_norm_weight, k_norm_weight, eps,
                  gemma=gemma, value_is_key=value_is_key, wrap=wrap, v=v)


def qkv_prep(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
             cache_k: torch.Tensor, cache_v: torch.Tensor, n_heads: int, n_kv: int,
             q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
             eps: float = 1e-6, gemma: bool = False, value_is_key: bool = False, wrap: bool = False,
             v: torch.Tensor | None = None) -> torch.Tensor:
    """Split qkv [T, (n_heads + 2 * n_kv) * hd] (unit stride along a row), RMS-normalize (both weights [hd] given)
    and rotate the query and key heads with cos / sin [T, hd], write the keys and the raw values into cache_k /
    cache_v [n_kv, capacity, hd] at rows positions [T] (int64), and return the queries [T, n_heads, hd], one
    kernel launch (module docstring: numerics, batch invariance). n_heads = 0: keys and values only (a drafter's
    context rows); both norm weights are then the key norm's.

    Gemma 4's attention (models.gemma4.model.Gemma4Attention's module path): gemma=True, its norms (the weight
    product in float32 before one rounding; the values RMS-normalized without a weight); value_is_key=True, qkv
    [T, (n_heads + n_kv) * hd] without value heads, the values being the keys before their norm and RoPE (the full
    layers); wrap=True, the cache a ring, row = position % capacity (the sliding layers).

    v [T, n_kv * hd]: the value heads from their own product (an attn_v of another type than attn_q / attn_k,
    whose product is then qkv [T, (n_heads + n_kv) * hd]): the bits of qkv_prep over the two concatenated, without
    the copy that concatenates them."""
    return _qkv_prep(qkv, cos, sin, positions, cache_k, cache_v, n_heads, n_kv, q_norm_weight, k_norm_weight, eps,
                     gemma, value_is_key, wrap, v)


def _segment_queries_like(qkv, cos, sin, positions, cache_k, cache_v, cache_offsets, n_heads, n_kv, q_norm_weight,
                          k_norm_weight, eps, v=None):
    return _queries_like(qkv, cos, sin, positions, cache_k, cache_v, n_heads, n_kv, q_norm_weight, k_norm_weight, eps,
                         v=v)


@opaque_op("flashdraft::qkv_prep_segments", _segment_queries_like, mutates_args=("cache_k", "cache_v"))
def _qkv_prep_segments(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       cache_k: torch.Tensor, cache_v: torch.Tensor, cache_offsets: torch.Tensor, n_heads: int,
                       n_kv: int, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                       eps: float, v: torch.Tensor | None = None) -> torch.Tensor:
    return launch(qkv, cos, sin, positions, cache_k, cache_v, n_heads, n_kv, q_norm_weight, k_norm_weight, eps,
                  cache_offsets, v=v)


def qkv_prep_segments(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      cache_k: torch.Tensor, cache_v: torch.Tensor, cache_offsets: torch.Tensor, n_heads: int,
                      n_kv: int, q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6, v: torch.Tensor | None = None) -> torch.Tensor:
    """qkv_prep for several sequences' rows in one launch (a batched step's layer): row t's keys and values go to
    the caches cache_offsets[t, 0] / [t, 1] elements after cache_k / cache_v (its sequence's caches of this
    layer: the same strides and capacity), at rows positions[t]; everything else as qkv_prep (a row's bits are
    its own), v included."""
    return _qkv_prep_segments(qkv, cos, sin, positions, cache_k, cache_v, cache_offsets, n_heads, n_kv,
                              q_norm_weight, k_norm_weight, eps, v)


def qkv_prep_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       cache_k: torch.Tensor, cache_v: torch.Tensor, n_heads: int, n_kv: int,
                       q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """qkv_prep in plain torch, the steps of Attention.forward's module path (the tests' reference): split,
    per-head elementwise.rms_norm, elementwise.rope, write_rows into the caches (index_copy_, rows quantized first
    for a cache of a block type)."""
    hd, _ = _checked(qkv, cos, sin, positions, cache_k, cache_v, n_heads, n_kv, q_norm_weight, k_norm_weight)
    q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)

    def rotated(x: torch.Tensor, heads: int, weight: torch.Tensor | None) -> torch.Tensor:
        x = x.unflatten(-1, (heads, hd))
        if weight is not None:
            x = elementwise.rms_norm(x, weight, eps)
        return elementwise.rope(x, cos.unsqueeze(-2), sin.unsqueeze(-2))  # [T, heads, hd]

    write_rows(cache_k, positions, rotated(k, n_kv, k_norm_weight).transpose(0, 1))
    write_rows(cache_v, positions, v.unflatten(-1, (n_kv, hd)).transpose(0, 1))
    return rotated(q, n_heads, q_norm_weight)
