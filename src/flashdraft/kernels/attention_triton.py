"""The Triton kernels behind flashdraft.layers.decode_attention (imported on first use, so that importing
flashdraft never needs Triton and a CPU test can still set TRITON_INTERPRET first).

Split-KV attention of a few query rows over a static cache, in one launch of `attention_kernel`, one program per
(kv head, BLOCK_Q-row query tile, SPLIT-row key range):
1. scores by tl.dot, the position mask, an online softmax over the range in BLOCK_N steps (unrolled, or a loop
   that Triton pipelines and that stops at the last step holding keys), and the range's fp32 partial output,
   row maximum and row sum, stored;
2. a ticket from a per-(kv head, tile) counter: the program that arrives last rescales and adds the partials in
   split order 0, 1, ... (`_combine`: a one-token tile's few rows with eight splits' loads in flight at once, a
   fuller tile's rows with each split's loads issued before the previous one is added) and
   writes the rows straight into the [T, heads * head_dim] layout o_proj reads, then sets the counter back to
   zero for the next launch. The order of the additions never depends on which program does them, and no
   second kernel (a launch per layer) is needed for it.

Query rows of one kv head are the T tokens times its group's heads, token-major (row r = t * group + g, so a
token's rows sit in the same tile places whatever T is). Every tile has BLOCK_Q rows and every key range SPLIT
keys whatever T is, and a row's arithmetic reads only its own q row and mask row, so a token's output is bitwise
the same whether 1 or 16 tokens go through (batch invariance, as the skinny GEMM). Keys hidden from a row add exact
zeros; a key range hidden from a row altogether gives it the partial (m = -inf, l = 0, acc = 0), which the combine
weighs by exactly 0.

SEGMENTED (a batched step's layer, decode_attention_segments): the rows are several sequences' in turn, each over
its own cache; axis 2 runs over (segment, key range), and each program reads its segment's first row, rows and
caches' offsets from a table, then does what a launch of that segment alone does (its tiles start at the
segment's first row; a tile past its rows reads no keys).

TMA (float caches, one sequence's launch): k_ptr and v_ptr are tensor descriptors over the [kv heads, kv_len,
head_dim] views, and a step's keys and values come by the copy engine (Hopper's TMA) instead of every thread's
address arithmetic and cp.async copies; the same values (rows past kv_len read as zeros, as the masked loads give
them), so the same arithmetic and bits as the tiling without it.

Quantized caches (KV cache types q8_0, q5_1, q5_0, q4_1, q4_0) are read as their packed blocks and dequantized in
registers (`_load_rows`), so a step reads the cache's bytes, not a dequantized copy of it. Their rows are laid out
by field (kv_formats): the quants load as contiguous vectors (ALIGN bytes wide, the rows' alignment) and each
block's fp16 scale once per row.
"""
import triton
import triton.language as tl

from flashdraft.kernels.split_reduce_triton import add, maximum, start_programmatic


@triton.jit(do_not_specialize=["T", "KV_LEN", "N_SPLITS"])
def attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, counter_ptr, out_ptr, seg_ptr, T, KV_LEN,
                     N_SPLITS, stride_qh, stride_qt, stride_kh, stride_kn, stride_vh, stride_vn, stride_mt, stride_ot,
                     qk_scale, GROUP: tl.constexpr, D: tl.constexpr, HAS_MASK: tl.constexpr,
                     IEEE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                     K_FMT: tl.constexpr, V_FMT: tl.constexpr, K_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr,
                     PIPELINED: tl.constexpr, SEGMENTED: tl.constexpr, TMA: tl.constexpr = False,
                     FEW_ROWS: tl.constexpr = 0, PDL: tl.constexpr = False):
    start_programmatic(PDL)
    kv = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    if SEGMENTED:  # several sequences' rows, each over its own cache: axis 2 is (segment, key range)
        seg = split // N_SPLITS
        split = split % N_SPLITS
        seg_pair = (seg * tl.num_programs(0) + kv) * tl.num_programs(1) + tile
        first = tl.load(seg_ptr + 4 * seg)  # the segment's first row, rows, and its caches' offsets from segment 0's
        T = tl.load(seg_ptr + 4 * seg + 1).to(tl.int32)
        k_ptr += tl.multiple_of(tl.load(seg_ptr + 4 * seg + 2), 16)
        v_ptr += tl.multiple_of(tl.load(seg_ptr + 4 * seg + 3), 16)
        q_ptr += first * stride_qt
        out_ptr += first * stride_ot
        mask_ptr += first * stride_mt
        # a tile past the segment's rows (segments have different lengths) reads no keys: its rows are all masked
        KV_LEN = tl.where(tile * BLOCK_Q < T * GROUP, KV_LEN, 0)
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < T * GROUP
    t = rows // GROUP
    head = kv * GROUP + rows % GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :], mask=row_ok[:, None],
                other=0.0)
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_Q], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q, D], 0.0, tl.float32)
    if PIPELINED:  # a loop Triton pipelines: the next steps' keys and values load while one computes
        # steps wholly past KV_LEN are skipped: they would add exact zeros (alpha 1, p 0), so a row keeps its bits
        # whether its pass's kv_len ends in its range or later (a verify step's), and a short context in a long
        # cache (a graph's 256-row bucket in 1024-key ranges) computes only the steps it has keys for
        steps = tl.minimum(SPLIT // BLOCK_N, (KV_LEN - split * SPLIT + BLOCK_N - 1) // BLOCK_N)
        for chunk in range(0, steps):
            m_i, l_i, acc = _key_step(q, m_i, l_i, acc, k_ptr, v_ptr, mask_ptr, kv, split, chunk, t, row_ok, KV_LEN,
                                      stride_kh, stride_kn, stride_vh, stride_vn, stride_mt, qk_scale, D, HAS_MASK,
                                      IEEE, BLOCK_N, SPLIT, K_FMT, V_FMT, K_ALIGN, V_ALIGN, TMA)
    else:
        for chunk in tl.static_range(SPLIT // BLOCK_N):
            m_i, l_i, acc = _key_step(q, m_i, l_i, acc, k_ptr, v_ptr, mask_ptr, kv, split, chunk, t, row_ok, KV_LEN,
                                      stride_kh, stride_kn, stride_vh, stride_vn, stride_mt, qk_scale, D, HAS_MASK,
                                      IEEE, BLOCK_N, SPLIT, K_FMT, V_FMT, K_ALIGN, V_ALIGN, TMA)
    # this (kv head, query tile)'s counter and partials. Where it is computed sets the registers a thread (ptxas,
    # sm_90), which decide whether two 8-warp programs share a multiprocessor: one sequence's after the key loop
    # (107 registers in the 32K tiling; 142 computed before it), a batched pass's before it (128; 144 after it)
    # (scripts/kernel_sass.py, tests/test_kernel_machine_code.py)
    if SEGMENTED:
        pair = seg_pair
    else:
        pair = kv * tl.num_programs(1) + tile
    slot = pair * N_SPLITS + split
    r = tl.arange(0, BLOCK_Q)
    tl.store(m_ptr + slot * BLOCK_Q + r, m_i, mask=row_ok)
    tl.store(l_ptr + slot * BLOCK_Q + r, l_i, mask=row_ok)
    tl.store(acc_ptr + (slot * BLOCK_Q + r)[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    # acq_rel: this program's partial is visible before its ticket; the last one's loads see every partial
    counter = counter_ptr + pair
    if tl.atomic_add(counter, 1, sem="acq_rel") == N_SPLITS - 1:
        _combine(m_ptr, l_ptr, acc_ptr, out_ptr, kv, tile, pair, T, N_SPLITS, stride_ot, GROUP, D, BLOCK_Q, FEW_ROWS)
        tl.atomic_xchg(counter, 0)


@triton.jit
def _key_step(q, m_i, l_i, acc, k_ptr, v_ptr, mask_ptr, kv, split, chunk, t, row_ok, KV_LEN, stride_kh, stride_kn,
              stride_vh, stride_vn, stride_mt, qk_scale, D: tl.constexpr, HAS_MASK: tl.constexpr,
              IEEE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, K_FMT: tl.constexpr,
              V_FMT: tl.constexpr, K_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr, TMA: tl.constexpr):
    """One BLOCK_N-key step of the online softmax over a program's key range: the running maximum, sum and output
    after keys chunk * BLOCK_N ... of range `split`."""
    n = split * SPLIT + chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < KV_LEN
    visible = row_ok[:, None] & n_ok[None, :]
    if HAS_MASK:
        visible = visible & (tl.load(mask_ptr + t[:, None] * stride_mt + n[None, :], mask=visible, other=0) != 0)
    # V's load goes out with K's (issued after the scores' softmax, it cost about 1 us more at 512 keys)
    if TMA:  # tensor descriptors over [kv heads, kv_len, D]: the copy engine's loads, rows past kv_len zeros
        first = split * SPLIT + chunk * BLOCK_N
        k = k_ptr.load([kv, first, 0]).reshape(BLOCK_N, D).to(q.dtype)
        v = v_ptr.load([kv, first, 0]).reshape(BLOCK_N, D).to(q.dtype)
    else:
        k = _load_rows(k_ptr, kv * stride_kh + n * stride_kn, n_ok, K_FMT, D, q.dtype, K_ALIGN)
        v = _load_rows(v_ptr, kv * stride_vh + n * stride_vn, n_ok, V_FMT, D, q.dtype, V_ALIGN)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * qk_scale, float("-inf"))  # log2 units: exp2 below
    m_new = tl.maximum(m_i, tl.reduce(s, 1, maximum))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, add)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _load_rows(ptr, rows, n_ok, FMT: tl.constexpr, D: tl.constexpr, OUT: tl.constexpr, ALIGN: tl.constexpr):
    """The cache rows starting at element offsets rows [BLOCK_N] (rows with n_ok False read as zeros) as
    [BLOCK_N, D] values of dtype OUT. FMT (kv_formats.KERNEL_FORMATS): 0 = values of the cache tensor's
    float dtype; else llama.cpp's blocks in a uint8 row laid out by field (kv_formats), dequantized here in
    float32 as kv_formats.dequantize_rows does, so a row reads bitwise the same values on both paths. ALIGN: a
    power of two that divides every row's byte offset."""
    ok = n_ok[:, None]
    if FMT == 0:
        x = tl.load(ptr + rows[:, None] + tl.arange(0, D)[None, :], mask=ok, other=0.0)
    else:
        row = ptr + tl.multiple_of(rows, ALIGN)[:, None]
        if FMT == 1:  # q8_0: D int8, then D / 32 fp16 scales; q * d
            q = tl.load(row + tl.arange(0, D)[None, :], mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            x = _scaled(q, row + D, ok, D, False)
        else:  # 4/5-bit: D / 2 nibble bytes, [D / 8 high-bit bytes], d, [m]; (q - offset) * d or q * d + m
            b = tl.load(row + tl.arange(0, D // 2)[None, :], mask=ok, other=0)
            q = tl.reshape(tl.join(b & 15, b >> 4), (b.shape[0], D)).to(tl.int32)
            at = D // 2
            if FMT == 4 or FMT == 5:  # q5_0, q5_1
                high = tl.load(row + at + tl.arange(0, D // 8)[None, :], mask=ok, other=0).to(tl.int32)
                bits = (high[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
                q = q | (tl.reshape(bits, (b.shape[0], D)) << 4)
                at = at + D // 8
            if FMT == 2:  # q4_0
                q = q - 8
            elif FMT == 4:  # q5_0
                q = q - 16
            x = _scaled(q.to(tl.float32), row + at, ok, D, FMT == 3 or FMT == 5)
    return x.to(OUT)


@triton.jit
def _scaled(q, scales, ok, D: tl.constexpr, AFFINE: tl.constexpr):
    """q [BLOCK_N, D] times its blocks' fp16 scales d (D / 32 of them at byte pointers `scales` [BLOCK_N, 1]), plus
    the minimums m that follow them (AFFINE), in float32."""
    nb: tl.constexpr = D // 32
    d_ptr = scales.to(tl.pointer_type(tl.float16))
    d = tl.load(d_ptr + tl.arange(0, nb)[None, :], mask=ok, other=0.0).to(tl.float32)
    x = tl.reshape(q, (q.shape[0], nb, 32)) * d[:, :, None]
    if AFFINE:
        m = tl.load(d_ptr + nb + tl.arange(0, nb)[None, :], mask=ok, other=0.0).to(tl.float32)
        x = x + m[:, :, None]
    return tl.reshape(x, (q.shape[0], D))


@triton.jit
def _combine(m_ptr, l_ptr, acc_ptr, out_ptr, kv, tile, pair, T, N_SPLITS, stride_ot, GROUP: tl.constexpr,
             D: tl.constexpr, BLOCK_Q: tl.constexpr, FEW_ROWS: tl.constexpr):
    """Add the N_SPLITS partials of (kv, tile) in split order 0, 1, ... and store the tile's rows of the output.

    A tile with at most FEW_ROWS rows to fill (a one-token step's group of heads; 0: never) takes only those rows
    and issues its loads COMBINE_BATCH splits at a time, so that the additions wait for memory once per batch
    (the chain's wait per split was most of the combine at 32K keys). Otherwise one pass over the whole tile with
    split s + 1's loads issued before split s is added. Both add each row's splits in the same order with the same
    arithmetic (`_add_partial`), so a row's bits do not depend on which way its tile went."""
    if FEW_ROWS > 0:
        if T * GROUP - tile * BLOCK_Q <= FEW_ROWS:
            _combine_rows(m_ptr, l_ptr, acc_ptr, out_ptr, kv, tile, pair, T, N_SPLITS, stride_ot, GROUP, D, BLOCK_Q,
                          FEW_ROWS, True)
        else:
            _combine_rows(m_ptr, l_ptr, acc_ptr, out_ptr, kv, tile, pair, T, N_SPLITS, stride_ot, GROUP, D, BLOCK_Q,
                          BLOCK_Q, False)
    else:
        _combine_rows(m_ptr, l_ptr, acc_ptr, out_ptr, kv, tile, pair, T, N_SPLITS, stride_ot, GROUP, D, BLOCK_Q,
                      BLOCK_Q, False)


COMBINE_BATCH = tl.constexpr(8)  # splits whose loads a few-row combine issues at once (_combine_rows's eight)


@triton.jit
def _combine_rows(m_ptr, l_ptr, acc_ptr, out_ptr, kv, tile, pair, T, N_SPLITS, stride_ot, GROUP: tl.constexpr,
                  D: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, BATCHED: tl.constexpr):
    """_combine over the tile's first ROWS rows: BATCHED, COMBINE_BATCH splits' loads at a time (splits past
    N_SPLITS read as hidden ranges, exact no-ops); else each split's loads one split ahead.

    The running maximum rescales each split's weight and the sums so far, as the online softmax of the key loop
    does. A key range hidden from a row gives it m = -inf, so it adds exact zeros and leaves the rescaling at
    exactly 1: a row's result does not depend on how many ranges follow its last visible one (a longer kv_len in a
    verify step). Loads bypass L1 (.cg): other programs wrote the partials."""
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    base = pair * N_SPLITS
    rows = tile * BLOCK_Q + r
    row_ok = rows < T * GROUP  # padding rows of the tile: nothing stored, nothing read
    m_run = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.full([ROWS], 0.0, tl.float32)
    acc = tl.full([ROWS, D], 0.0, tl.float32)
    # while loops: Triton's interpreter (the CPU tests) cannot range() over a runtime bound
    s = 0
    if BATCHED:
        while s < N_SPLITS:
            m0, l0, a0 = _partial(m_ptr, l_ptr, acc_ptr, base, s, N_SPLITS, r, d, row_ok, BLOCK_Q, D)
            m1, l1, a1 = _partial(m_ptr, l_ptr, acc_ptr, base, s + 1, N_SPLITS, r, d, row_ok, BLOCK_Q, D)
            m2, l2, a2 = _partial(m_ptr, l_ptr, acc_ptr, base, s + 2, N_SPLITS, r, d, row_ok, BLOCK_Q, D)
            m3, l3, a3 = _partial(m_ptr, l_ptr, acc_ptr, base, s + 3, N_SPLITS, r, d, row_ok, BLOCK_Q, D)
            m4, l4, a4 = _partial(m_ptr, l_ptr, acc_ptr, base, s + 4, N_SPLITS, r, d, row_ok, BLOCK_Q, D)
            m5, l5, a5 = _partial(m_ptr, l_ptr, acc_ptr, base, s + 5, N_SPLITS, r, d, row_ok, BLOCK_Q, D)
            m6, l6, a6 = _partial(m_ptr, l_ptr, acc_ptr, base, s + 6, N_SPLITS, r, d, row_ok, BLOCK_Q, D)
            m7, l7, a7 = _partial(m_ptr, l_ptr, acc_ptr, base, s + 7, N_SPLITS, r, d, row_ok, BLOCK_Q, D)
            m_run, total, acc = _add_partial(m_run, total, acc, m0, l0, a0)
            m_run, total, acc = _add_partial(m_run, total, acc, m1, l1, a1)
            m_run, total, acc = _add_partial(m_run, total, acc, m2, l2, a2)
            m_run, total, acc = _add_partial(m_run, total, acc, m3, l3, a3)
            m_run, total, acc = _add_partial(m_run, total, acc, m4, l4, a4)
            m_run, total, acc = _add_partial(m_run, total, acc, m5, l5, a5)
            m_run, total, acc = _add_partial(m_run, total, acc, m6, l6, a6)
            m_run, total, acc = _add_partial(m_run, total, acc, m7, l7, a7)
            s += COMBINE_BATCH
    else:
        m_next, l_next, acc_next = _partial(m_ptr, l_ptr, acc_ptr, base, 0, N_SPLITS, r, d, row_ok, BLOCK_Q, D)
        while s < N_SPLITS:
            m_s, l_s, acc_s = m_next, l_next, acc_next
            m_next, l_next, acc_next = _partial(m_ptr, l_ptr, acc_ptr, base, s + 1, N_SPLITS, r, d, row_ok, BLOCK_Q,
                                                D)
            m_run, total, acc = _add_partial(m_run, total, acc, m_s, l_s, acc_s)
            s += 1
    t = rows // GROUP
    head = kv * GROUP + rows % GROUP
    out = acc / tl.where(row_ok, total, 1.0)[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _partial(m_ptr, l_ptr, acc_ptr, base, s, N_SPLITS, r, d, row_ok, BLOCK_Q: tl.constexpr, D: tl.constexpr):
    """Split s's partial (row maximum, row sum, output) of rows r; a split past N_SPLITS reads as hidden
    (-inf, 0, 0)."""
    ok = row_ok & (s < N_SPLITS)
    slot = (base + s) * BLOCK_Q + r
    m = tl.load(m_ptr + slot, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_sum = tl.load(l_ptr + slot, mask=ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(acc_ptr + slot[:, None] * D + d[None, :], mask=ok[:, None], other=0.0, cache_modifier=".cg")
    return m, l_sum, acc


@triton.jit
def _add_partial(m_run, total, acc, m_s, l_s, acc_s):
    """The sums so far and one more split's partial, both rescaled to their joint maximum."""
    m_new = tl.maximum(m_run, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: no NaN from -inf - -inf
    alpha = tl.math.exp2(m_run - m_safe)
    w = tl.math.exp2(m_s - m_safe)
    total = total * alpha + w * l_s
    acc = acc * alpha[:, None] + w[:, None] * acc_s
    return m_new, total, acc
