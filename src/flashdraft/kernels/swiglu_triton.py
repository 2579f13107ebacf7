"""The Triton kernel behind flashdraft.layers.swiglu_rows (imported on first use, as rms_norm_triton).

One program per (row, block of features): silu(gate) * up of a fused [gate | up] projection's output, each value
from its own row's gate and up alone (batch invariance). Float32 arithmetic rounded where the eager
`F.silu(gate) * up` rounds: silu's result, then the product.
"""
import triton
import triton.language as tl

from flashdraft.kernels.split_reduce_triton import round_to, start_programmatic


@triton.jit
def swiglu_kernel(gu_ptr, y_ptr, stride_gu, stride_y, N, BLOCK: tl.constexpr, EMULATE: tl.constexpr,
                  PDL: tl.constexpr = False):
    start_programmatic(PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = y_ptr.dtype.element_ty
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + N + cols, mask=ok, other=0.0).to(tl.float32)
    silu = round_to(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), dtype, EMULATE)
    tl.store(y_ptr + row * stride_y + cols, round_to(silu * up, dtype, EMULATE).to(dtype), mask=ok)
