"""The Triton kernel behind flashdraft.layers.rms_norm_rows (imported on first use, so that importing flashdraft
never needs Triton and a CPU test can still set TRITON_INTERPRET first).

One program per row, the whole row in one block: the row's sum of squares is one tl.reduce over its own values,
so nothing depends on how many rows the pass has (batch invariance). Arithmetic is float32, rounded to the tensor
dtype where elementwise.rms_norm's eager path rounds: after the residual add, after the normalization and after
the weight product (a product or sum of two bf16/fp16 values rounded once, as torch's op rounds it). Only the sum
of squares can differ from torch's in its last bits (its own summation order).
"""
import triton
import triton.language as tl

from flashdraft.kernels.split_reduce_triton import add, round_to, start_programmatic


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, stride_x, stride_r, stride_s, stride_y, N, eps,
                    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr = False):
    start_programmatic(PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = y_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # s = x + r in dtype, the sum that is normalized
        x = round_to(x + tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32), dtype, EMULATE)
        tl.store(s_ptr + row * stride_s + cols, x.to(dtype), mask=ok)
    inv_rms = tl.math.rsqrt(tl.reduce(x * x, 0, add) / N + eps)
    y = round_to(tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * round_to(x * inv_rms, dtype, EMULATE),
               dtype, EMULATE)
    tl.store(y_ptr + row * stride_y + cols, y.to(dtype), mask=ok)


@triton.jit
def gemma_norms_kernel(x_ptr, h_ptr, wx_ptr, scalar_ptr, wy_ptr, s_ptr, y_ptr, stride_x, stride_h, stride_s,
                       stride_y, N, eps, BLOCK: tl.constexpr, ADD: tl.constexpr, WEIGHT: tl.constexpr,
                       SCALE: tl.constexpr, NEXT: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr = False):
    """A Gemma 4 layer's branch output x joining its residual h: s = h + norm(x) wx (then times the layer scalar,
    SCALE), and the norm of s for the next product, y = norm(s) wy (NEXT). Without ADD, s = norm(x) wx alone;
    without WEIGHT, norm(x) unweighted. Each norm as Gemma4RMSNorm: float32 throughout, rounded once after the
    weight product; the sum and the scalar product rounded as torch's ops."""
    start_programmatic(PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = s_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    normed = x * tl.math.rsqrt(tl.reduce(x * x, 0, add) / N + eps)
    if WEIGHT:
        normed = normed * tl.load(wx_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    s = round_to(normed, dtype, EMULATE)
    if ADD:
        s = round_to(tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32) + s, dtype, EMULATE)
    if SCALE:
        s = round_to(s * tl.load(scalar_ptr).to(tl.float32), dtype, EMULATE)
    tl.store(s_ptr + row * stride_s + cols, s.to(dtype), mask=ok)
    if NEXT:
        wy = tl.load(wy_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        y = round_to(s * tl.math.rsqrt(tl.reduce(s * s, 0, add) / N + eps) * wy, dtype, EMULATE)
        tl.store(y_ptr + row * stride_y + cols, y.to(dtype), mask=ok)
