"""Triton pieces shared by the other kernels here: the split-K reduce that adds fp32 partials in a fixed order, the
interpreter's rounding, the start of a programmatic dependent launch, and tl.reduce's combine functions
(triton.language's own jit reductions, tl.max and tl.sum among them, break under an interpreter switched on after
Triton's import, as the CPU tests do; Triton builtins and these do not).

Imported only by those kernel modules, on first use (see flashdraft.kernels.skinny_triton for why kernels are
decorated late), so importing flashdraft never needs Triton.
"""
import triton
import triton.language as tl


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def start_programmatic(PDL: tl.constexpr):
    """With PDL (launched as a programmatic dependent, kernels.programmatic): let the next kernel launch, and wait
    for the earlier kernels' writes; before the kernel's first load."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def round_to(v, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """float32 v rounded to `dtype` (nearest, ties to even), kept in float32: the rounding of an eager torch op
    whose result is stored in dtype. EMULATE: round bf16 on the bits, for Triton's interpreter, whose casts to bf16
    truncate (in 64 bits: the interpreter checks every narrower integer sum for overflow, which is slow)."""
    if dtype == tl.float32:
        return v
    elif EMULATE and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True).to(tl.int64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def split_reduce_kernel(p_ptr, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                        SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, r_ptr=None, stride_rm=0,
                        HAS_RESIDUAL: tl.constexpr = False):
    """y[m, n] = ((p[0, m, n] + p[1, m, n]) + p[2, m, n]) + ... (+ bias[n]) (+ r[m, n]): always the same order.
    UPCAST: round to y's dtype by hand (round_to) before the store, for the interpreter."""
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    row = p_ptr + m.to(tl.int64) * N + rn
    acc = tl.load(row, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(row + s * M.to(tl.int64) * N, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + m.to(tl.int64) * stride_rm + rn, mask=ok, other=0.0).to(tl.float32)
    if UPCAST:
        acc = round_to(acc, y_ptr.dtype.element_ty, True)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=ok)
