"""The Triton kernels behind flashdraft.layers.skinny_gemm (imported lazily, on first use, by that module), with
the split-K reduce (flashdraft.kernels.split_reduce_triton) that its launch calls as split_reduce_kernel.

Kept apart so that importing flashdraft never needs Triton, and so that TRITON_INTERPRET (read by triton.jit
when these functions are decorated, i.e. when this module is first imported) can still be set by a CPU test.

y[M, N] = x[M, K] @ W[N, K]^T with fp32 accumulation. Every program owns BLOCK_N output features of one BLOCK_M-row
tile (BLOCK_M fixed per tiling, 16 by default, 64 for a batched pass's rows where the tiling has them; rows past M
are loaded as zeros) and one fixed K range, and walks that range in BLOCK_K steps from low to high K. Nothing in a
tile's instruction sequence depends on M (only which padding rows are zero), and a tensor-core product's output row
depends only on its own input row, so row m of y is bitwise the same for every M: batch invariance. With SPLIT_K > 1
the K ranges are fixed by (K, SPLIT_K, BLOCK_K) alone and a second kernel adds the fp32 partials in split order 0,
1, ...

Optional fusions (constexpr switches), so that a decoder layer's norms, SwiGLU and residual adds need no kernels
of their own: HAS_NORM (RMSNorm of x without its weight, which the caller folds into W: the loop also forms x x^T
with the tensor cores, whose diagonal is each row's sum of squares, and the epilogue scales each row by its
1 / rms; x itself goes to tl.dot untouched, so the loads stay pipelined, where an elementwise product on x before
the dot made every K step wait for its load), GATED (W = [gate; up]: a second accumulator for the up rows of the
same features, and silu(gate) * up in the epilogue) and HAS_RESIDUAL (+ r[m, n] in the epilogue, or in the
split-K reduce). All stay per row and fixed by (N, K), so by construction batch invariance holds for them too;
yet on the H200 one tiling of the gated product with the norm gave rows that differed with M (cause not found),
so the model uses measured tilings (skinny_gemm.GATED_CONFIGS) and GPU scripts check invariance per tiling.
"""
import triton
import triton.language as tl

from flashdraft.kernels.split_reduce_triton import add, split_reduce_kernel  # noqa: F401 (skinny_gemm launches it)

# Only Triton builtins below, none of triton.language's own @triton.jit helpers (tl.zeros, tl.cdiv, ...): those
# are decorated when Triton is first imported, so under the interpreter they would only work if TRITON_INTERPRET
# had been set before that, while these kernels are decorated when this module is imported (first use).


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b: IEEE products for fp32 operands (so the CPU tests compare exact float32), else tf32/bf16."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tile_products(x_ptrs, m_ok, k_ok, w, wu, acc, acc_up, gram, EVEN_K: tl.constexpr, HAS_NORM: tl.constexpr,
                   GATED: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr, UPCAST: tl.constexpr):
    """A row tile's share of a K step: its x tile, then the products with the weight tile(s) already loaded."""
    if EVEN_K:
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)
    else:
        x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)
    if UPCAST:  # Triton's interpreter only: its tl.dot multiplies bf16 operands' raw bits (3.6)
        x = x.to(tl.float32)
    if HAS_NORM:
        gram = _dot(x, tl.trans(x), gram, IEEE)
    if SWAP:
        acc = _dot(w, tl.trans(x), acc, IEEE)
        if GATED:
            acc_up = _dot(wu, tl.trans(x), acc_up, IEEE)
    else:
        acc = _dot(x, tl.trans(w), acc, IEEE)
        if GATED:
            acc_up = _dot(x, tl.trans(wu), acc_up, IEEE)
    return acc, acc_up, gram


@triton.jit
def _store_tile(acc, acc_up, gram, rm, rn, pid_k, M, N, eps, b_ptr, y_ptr, p_ptr, r_ptr, stride_ym, stride_rm,
                K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                GATED: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """A row tile's epilogue: on [BLOCK_M, BLOCK_N] tiles (a swapped accumulator transposed first), all in
    fp32, rounded once on the store; with SPLIT_K > 1 the fp32 partial is stored instead."""
    if SWAP:
        out = tl.trans(acc)
        if GATED:
            up = tl.trans(acc_up)
    else:
        out = acc
        if GATED:
            up = acc_up
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        if HAS_NORM:  # padding rows have a zero sum: rsqrt(eps) stays finite, and they are not stored
            diagonal = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
            inv_rms = tl.rsqrt(tl.reduce(tl.where(diagonal, gram, 0.0), 1, add) / K + eps)[:, None]
            out = out * inv_rms
            if GATED:
                up = up * inv_rms
        if HAS_BIAS:
            out = out + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if GATED:
                up = up + tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if GATED:  # silu(gate) * up
            out = out / (1.0 + tl.exp(-out)) * up
        if HAS_RESIDUAL:
            out = out + tl.load(r_ptr + rm[:, None].to(tl.int64) * stride_rm + rn[None, :], mask=mask,
                                other=0.0).to(tl.float32)
        tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=mask)
    else:
        # fp32 partials [SPLIT_K, M, N]; split_reduce_kernel adds them in split order (then bias and residual).
        base = p_ptr + pid_k.to(tl.int64) * M * N
        tl.store(base + rm[:, None].to(tl.int64) * N + rn[None, :], out, mask=mask)


# M is never specialized (Triton would otherwise compile separate variants for M == 1 and M % 16 == 0): one
# compiled kernel serves every M, which batch invariance relies on.
@triton.jit(do_not_specialize=["M"])
def skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, p_ptr, r_ptr, M, N, stride_xm, stride_wn, stride_ym,
                       stride_rm, eps, K: tl.constexpr, STEPS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                       IEEE: tl.constexpr, SWAP: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, W_EVICT: tl.constexpr):
    """N is the number of output features: with GATED, W has 2N rows (gate rows [0, N) over up rows [N, 2N)).
    HAS_NORM and GATED need SPLIT_K == 1 (the row norm needs all of K; silu needs the whole gate product).
    W_EVICT: the weight loads' L2 eviction policy: "evict_first" where one program reads each weight tile (the
    weights stream through L2 once), "" (the default) where several do, so that the later programs find the tile
    in L2; a cache hint, no change to the arithmetic."""
    if PDL:  # launched as a programmatic dependent: wait here for the previous kernel's writes (our input)
        tl.extra.cuda.gdc_wait()
    # Row programs vary fastest: the programs of one weight tile for every row tile run side by side, so that the
    # weight tile comes from HBM once and from L2 for the others.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # This split's K range: STEPS = ceil(ceil(K / BLOCK_K) / SPLIT_K) steps of BLOCK_K from k_lo, fixed by K,
    # SPLIT_K and BLOCK_K (never by M). K is a compile-time constant (a handful of weight widths per model).
    k_lo = pid_k * STEPS * BLOCK_K
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    n_ok = rn[:, None] < N
    if SWAP:
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    else:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    # Placeholders where a fusion is off (returned untouched): the up accumulator, the up weight tile, the Gram
    # matrix x x^T over the K steps (its diagonal is each row's sum of squares).
    up = acc
    gram = acc
    if HAS_NORM:
        gram = tl.full((BLOCK_M, BLOCK_M), 0.0, tl.float32)
    if GATED:  # the up rows of the same output features, N weight rows further on
        wu_ptrs = w_ptrs + N * stride_wn
    if EVEN_K:
        k_ok = n_ok  # unused: only an uneven K masks the K edge
    for step in range(0, STEPS):
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_ptrs, eviction_policy=W_EVICT)
                wu = w
                if GATED:
                    wu = tl.load(wu_ptrs, eviction_policy=W_EVICT)
            else:
                w = tl.load(w_ptrs, mask=n_ok, other=0.0, eviction_policy=W_EVICT)
                wu = w
                if GATED:
                    wu = tl.load(wu_ptrs, mask=n_ok, other=0.0, eviction_policy=W_EVICT)
        else:
            k_ok = (k_lo + step * BLOCK_K + rk)[None, :] < K
            w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0.0, eviction_policy=W_EVICT)
            wu = w
            if GATED:
                wu = tl.load(wu_ptrs, mask=n_ok & k_ok, other=0.0, eviction_policy=W_EVICT)
        if UPCAST:  # Triton's interpreter only: its tl.dot multiplies bf16 operands' raw bits (3.6)
            w = w.to(tl.float32)
            wu = wu.to(tl.float32)
        acc, up, gram = _tile_products(x_ptrs, rm[:, None] < M, k_ok, w, wu, acc, up, gram, EVEN_K, HAS_NORM, GATED,
                                       IEEE, SWAP, UPCAST)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        if GATED:
            wu_ptrs += BLOCK_K
    _store_tile(acc, up, gram, rm, rn, pid_k, M, N, eps, b_ptr, y_ptr, p_ptr, r_ptr, stride_ym, stride_rm, K,
                HAS_BIAS, HAS_NORM, HAS_RESIDUAL, GATED, SWAP, BLOCK_M, SPLIT_K)
