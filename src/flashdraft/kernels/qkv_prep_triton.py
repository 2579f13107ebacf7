"""The Triton kernel behind flashdraft.layers.qkv_prep (imported on first use, so that importing flashdraft never
needs Triton and a CPU test can still set TRITON_INTERPRET first).

One program per (token, head slot): slots 0..N_HEADS-1 are the query heads, slot N_HEADS + j is key head j together
with value head j. Query head h and key head j start at columns h * D and (N_HEADS + j) * D of the token's row of
the fused q/k/v product (the key heads follow the query heads), so slot s starts at s * D either way. A program
loads its head twice, in order and with its halves swapped (rotate_half(x) is the swapped copy with its first half
negated: no shuffle of registers, and the second load hits the cache), RMS-normalizes both copies (HAS_NORM),
applies RoPE and stores a query head into q, or a key head and the raw value head into the caches at row
positions[t]. Nothing depends on T, so a token's outputs are the same bits whatever else goes through.

Arithmetic is float32 with a rounding to the tensor dtype wherever the eager torch path (elementwise.rms_norm,
elementwise.rope) rounds: after the float32 normalization, after the weight product, after cos/sin are cast, after
each RoPE product and after the RoPE sum. A product of two bf16/fp16 values is exact in float32, so each step
rounds exactly as torch's bf16/fp16 op does. The launcher switches off FMA contraction, which would fuse a product
and a sum into one rounding that the eager path does not make (the float32 case's RoPE, the mean of squares).
Only the mean of squares can differ in its last bits: its summation order is this kernel's own (and on the GPU
its rsqrt is the hardware approximation, as torch's is).

GEMMA: Gemma 4's attention (models.gemma4.model): its RMSNorm multiplies by the weight in float32 and rounds once
(weight * x * rsqrt(...), not weight * round(x * rsqrt(...))), and the values are RMS-normalized without a weight
(v_norm) before they are stored. V_IS_K: the row holds no value heads; value head j is key head j before its norm
and RoPE (Gemma 4's full layers, attention_k_eq_v). WRAP: the cache is a ring, row = position % capacity (Gemma
4's sliding layers). V_APART: the row holds no value heads; they come from v_ptr's rows, their own product (an
attn_v of another type than attn_q / attn_k, which are then one product: Q4_K_M files' Q6_K attn_v).

K_FMT / V_FMT (kv_formats.KERNEL_FORMATS; 0: rows of the compute dtype): a cache of llama.cpp's block types
(-ctk / -ctv), its rows quantized here from the values rounded to the compute dtype, byte for byte what
kv_formats.quantize makes of those rows (gguf-py's arithmetic: IEEE divisions, C's roundf or truncation, the
first value of largest magnitude for the symmetric types) in its by-field layout: quants, the 5-bit types' high
bits, the fp16 scales, the affine types' fp16 minimums. A row is quantized from its own values alone.
"""
import triton
import triton.language as tl

from flashdraft.kernels.split_reduce_triton import add, maximum, minimum, round_to, start_programmatic


@triton.jit
def qkv_prep_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_norm_ptr, k_norm_ptr, q_ptr, cache_k_ptr, cache_v_ptr,
                    offsets_ptr, v_ptr, stride_qkv, stride_cos, stride_sin, stride_kh, stride_kn, stride_vh,
                    stride_vn, stride_v, capacity, eps, N_HEADS: tl.constexpr, N_KV: tl.constexpr, D: tl.constexpr,
                    HAS_NORM: tl.constexpr, EMULATE: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                    GEMMA: tl.constexpr = False, V_IS_K: tl.constexpr = False, WRAP: tl.constexpr = False,
                    K_FMT: tl.constexpr = 0, V_FMT: tl.constexpr = 0, V_APART: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    start_programmatic(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    d = tl.arange(0, D)
    half = D // 2
    swapped = (d + half) % D  # rotate_half(x)[d] = -x[d + half] for d < half, x[d - half] after
    head = qkv_ptr + t * stride_qkv + slot * D
    x = tl.load(head + d).to(tl.float32)
    x_swapped = tl.load(head + swapped).to(tl.float32)
    raw = x
    inv_rms = 1.0
    if HAS_NORM:
        # weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype), rounded to dtype (the mean as torch's:
        # the sum times 1 / D, exact for a power of two); the swapped copy takes the same per-element steps
        inv_rms = tl.math.rsqrt(tl.reduce(x * x, 0, add) * (1.0 / D) + eps)
        if slot < N_HEADS:
            norm_ptr = q_norm_ptr
        else:
            norm_ptr = k_norm_ptr
        if GEMMA:  # (x.float() * rsqrt(...) * weight.float()).to(dtype): one rounding
            x = round_to(x * inv_rms * tl.load(norm_ptr + d).to(tl.float32), dtype, EMULATE)
            x_swapped = round_to(x_swapped * inv_rms * tl.load(norm_ptr + swapped).to(tl.float32), dtype, EMULATE)
        else:
            x = round_to(tl.load(norm_ptr + d).to(tl.float32) * round_to(x * inv_rms, dtype, EMULATE), dtype,
                         EMULATE)
            x_swapped = round_to(tl.load(norm_ptr + swapped).to(tl.float32)
                                 * round_to(x_swapped * inv_rms, dtype, EMULATE), dtype, EMULATE)
    rotated = tl.where(d < half, -x_swapped, x_swapped)
    # x * cos + rotate_half(x) * sin with cos and sin cast to dtype, each product and the sum rounded to dtype
    cos = round_to(tl.load(cos_ptr + t * stride_cos + d).to(tl.float32), dtype, EMULATE)
    sin = round_to(tl.load(sin_ptr + t * stride_sin + d).to(tl.float32), dtype, EMULATE)
    out = round_to(round_to(x * cos, dtype, EMULATE) + round_to(rotated * sin, dtype, EMULATE), dtype, EMULATE)
    out = out.to(dtype)
    if slot < N_HEADS:
        tl.store(q_ptr + (t * N_HEADS + slot) * D + d, out)
    else:
        kv = (slot - N_HEADS).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        if WRAP:
            pos = pos % capacity
        if HAS_OFFSETS:  # the token's sequence's caches, these many elements from the given ones
            cache_k_ptr += tl.multiple_of(tl.load(offsets_ptr + 2 * t), 16)
            cache_v_ptr += tl.multiple_of(tl.load(offsets_ptr + 2 * t + 1), 16)
        if (pos >= 0) & (pos < capacity):  # an out-of-range position writes nothing rather than past the cache
            _store_row(cache_k_ptr + kv * stride_kh + pos * stride_kn, out, K_FMT, D)
            if V_IS_K:  # the key head as loaded, before its norm (its mean of squares is the value's)
                value = raw
            else:
                if V_APART:  # value head j of the token's row of their own product
                    value = tl.load(v_ptr + t * stride_v + kv * D + d).to(tl.float32)
                else:  # value head j sits N_KV heads after key head j
                    value = tl.load(head + N_KV * D + d).to(tl.float32)
                if GEMMA:  # the value's own mean of squares
                    inv_rms = tl.math.rsqrt(tl.reduce(value * value, 0, add) * (1.0 / D) + eps)
            if GEMMA:  # v_norm: (v.float() * rsqrt(mean(v^2) + eps)).to(dtype)
                value = value * inv_rms
            _store_row(cache_v_ptr + kv * stride_vh + pos * stride_vn, round_to(value, dtype, EMULATE).to(dtype),
                       V_FMT, D)


@triton.jit
def _store_row(row, x, FMT: tl.constexpr, D: tl.constexpr):
    """Store one cache row of D values x (of the compute dtype) at `row`: as they are (FMT 0), or quantized into
    the block type FMT (module docstring) from their float32 values, 32 a block."""
    if FMT == 0:
        tl.store(row + tl.arange(0, D), x.to(row.dtype.element_ty))
    else:
        nb: tl.constexpr = D // 32
        v = tl.reshape(x.to(tl.float32), (nb, 32))
        if FMT == 1:  # q8_0: d = max |x| / 127, q = roundf(x / d) as int8
            amax = tl.reduce(tl.abs(v), 1, maximum)
            d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
            y = v * _inverse(d)[:, None]
            a = tl.abs(y)
            floored = tl.math.floor(a)
            rounded = floored + tl.math.floor(2.0 * (a - floored))  # C's roundf of |y|: halves away from zero
            q = tl.where(y < 0, -rounded, rounded).to(tl.int32)
            tl.store(row + tl.arange(0, D), tl.reshape(q, (D,)).to(tl.int8).to(tl.uint8, bitcast=True))
            _store_halves(row + D, d, nb)
        else:
            if FMT == 2 or FMT == 4:  # q4_0 / q5_0: d = (first value of largest magnitude) / -levels
                levels: tl.constexpr = 4 * FMT  # 8 or 16
                a = tl.abs(v)
                largest = tl.reduce(a, 1, maximum)
                k = tl.arange(0, 32)[None, :]
                first = tl.reduce(tl.where(a == largest[:, None], k, 32), 1, minimum)
                peak = tl.reduce(tl.where(k == first[:, None], v, float("-inf")), 1, maximum)
                d = tl.math.div_rn(peak, tl.full(peak.shape, -levels, tl.float32))
                q = (v * _inverse(d)[:, None] + (levels + 0.5)).to(tl.int32)  # trunc: the sum is above -1
                q = tl.minimum(tl.maximum(q, 0), 2 * levels - 1)
            else:  # q4_1 / q5_1: m = min, d = (max - min) / levels
                levels: tl.constexpr = 8 * FMT - 9  # 15 or 31
                lo = tl.reduce(v, 1, minimum)
                d = tl.math.div_rn(tl.reduce(v, 1, maximum) - lo, tl.full(lo.shape, levels, tl.float32))
                q = ((v - lo[:, None]) * _inverse(d)[:, None] + 0.5).to(tl.int32)
                q = tl.minimum(tl.maximum(q, 0), levels)
            q = tl.reshape(q, (D,))
            even, odd = tl.split(tl.reshape(q, (D // 2, 2)))
            tl.store(row + tl.arange(0, D // 2), ((even & 15) | ((odd & 15) << 4)).to(tl.uint8))
            scales = row + D // 2
            if FMT == 4 or FMT == 5:  # bit t of high byte b: bit 4 of value 8b + t
                bits = (tl.reshape(q, (D // 8, 8)) >> 4) & 1
                high = tl.reduce(bits << tl.arange(0, 8)[None, :], 1, add)
                tl.store(scales + tl.arange(0, D // 8), high.to(tl.uint8))
                scales += D // 8
            _store_halves(scales, d, nb)
            if FMT == 3 or FMT == 5:
                _store_halves(scales + 2 * nb, lo, nb)


@triton.jit
def _inverse(d):
    """1 / d (IEEE), 0 where d is 0 (kv_formats._inverse)."""
    return tl.where(d == 0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d == 0, 1.0, d)))


@triton.jit
def _store_halves(ptr, x, n: tl.constexpr):
    """x float32 [n] as fp16 (round to nearest even), two bytes each, low byte first, at byte pointer ptr."""
    bits = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    pair = tl.reshape(tl.join(bits & 255, (bits >> 8) & 255), (2 * n,))
    tl.store(ptr + tl.arange(0, 2 * n), pair.to(tl.uint8))
