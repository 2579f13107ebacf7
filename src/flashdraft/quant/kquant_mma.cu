// GGUF k-quant weights (Q4_K, Q5_K, Q6_K) times 1-16 rows of bf16 x on the tensor cores, from register fragments
// (no block barriers). Compiled at first use by NVRTC (flashdraft.quant.mma_kernels): kq_mma with QTYPE (4, 5 or 6),
// COLUMNS (0 or 1), CHUNK_ROWS, R_TILES, NT, WARPS, MINB, STAGES and RING_BULK defined in front of this text, once
// per type and tiling.
//
// W: GGUF blocks, row-major uint8 [N, K / 256 * BLOCK_BYTES] (Q6_K: lane-order rows, row_stride bytes apart; Q4_K
// with COLUMNS: super-block-major, row_offset / sb_offset). X: bf16
// [M, K], M <= 8 * NT. With one K range (gridDim.y 1) the kernel rounds its sums to bf16 into Y [M, N]. With several (a
// split), each warp writes its range's sums into P, float32 [split, M, N], and counts itself in C[its warp column]
// (uint32, zero between launches); the warp that counts last for its rows adds their split sums in range order 0, 1,
// ... (the same adds whichever warp that is), rounds them into Y and sets its count back to zero: no reduce launch of
// its own. Given a residual R (bf16 [M, N], has_r 1), Y gets y + R instead: y rounded to bf16, then the sum rounded
// again, torch's bf16 add of the two bit for bit.
//
// Q4_K and Q5_K (one part of the kernel). Each warp owns R_TILES tiles of 16 weight rows and one K range. Per 32-weight
// sub-block j of a super-block the tensor cores form s_j = x . (128 + q) for NT tiles of 8 tokens (bf16 128 + q is
// exact for q < 128, so are the products; fp32 sums) and sum(x_j) (the ones-MMA), and the warp adds d sc_j s_j per row
// and token. Once per super-block it subtracts sum over j of (128 d sc_j + dmin m_j) sum(x_j) with two more MMAs
// (A: the 6-bit sc_j or m_j of the rows, exact in bf16; B: the sums of x, split into three bf16 parts, exact to
// fp32's precision, and transposed by movmatrix into B's layout), instead of two fmas per sub-block, row and token.
// Together: sum over the super-block of x (d sc_j q - dmin m_j), gguf's weight. The weights are never rounded: only
// the products' sums are. Q5_K's fifth bit (qh) is put under the nibble before the byte permute; nothing else differs.
//
// Fragments: lane (g = lane / 4, c = lane % 4) reads, of rows g and g + 8 of a tile, the 8 bytes at 8c of each
// 32-byte run of quants, and x[token][32 j + 8c .. 8c + 7]. Reading the sub-block's position p = 8c + 4s + e as MMA
// k-step s, k = 2c + e (e < 2) or 2c + 8 + e - 2 (e >= 2), both operands' fragments are exactly those loads: one
// byte permute puts two nibbles under the exponent byte of 128.0 (bf16 0x43), giving the A register of k 2c, 2c + 1
// (bytes 0, 1) or 2c + 8, 2c + 9 (bytes 2, 3).
//
// Where the weight bytes come from: with STAGES 0, each lane loads its fragments' bytes from global memory when
// it reaches a super-block (the loads in flight are what the warps' registers hold). With STAGES n > 0, each warp
// keeps a ring of n super-blocks of its rows in shared memory, filled by cp.async STAGES - 1 super-blocks ahead of
// the one it computes: more bytes in flight per multiprocessor without more registers. Rows sit ROWB bytes apart
// there (the block padded so that the fragment reads of a half-warp hit 32 different banks). Same arithmetic.
// With RING_BULK 1 (Q4_K_COLUMNS, compute capability 9.0): a warp's rows at one super-block are one run of
// R_TILES x 16 x 144 bytes in that layout, so lane 0 fills a stage with one cp.async.bulk (the copy engine, an
// mbarrier a stage) where the lanes issue 16-byte cp.async each; rows then lie 144 bytes apart, and lane group g
// takes the fragments of tile row frag_row(g) so that a half-warp's reads still hit 32 different banks.
//
// Q6_K (its own part of the kernel): weights d sc q - 32 d sc with a signed scale per 16 weights and no minimum, so
// one MMA k-step is one 16-weight group: lane c holds the group's positions 4c .. 4c + 3, 128 + q is again exact in
// bf16 (q < 64) and the group adds d sc (s - 160 sum(x)), the -160 sum(x) as the C of the weights' MMAs (an MMA
// of x with an A of -160s gives it in their C layout, so a group's scale is one fma a sum). The weights come in lane
// order (Q6_K_LANES, flashdraft.quant.q6k_lanes: GGUF's 210-byte blocks are only 2-byte aligned): per super-block
// and row, lane c's low-nibble, high-nibble and high-bit words are three aligned 16-byte loads, the scales a
// fourth, and d a 16-bit load from the row's end. No shared-memory ring for it (yet).
//
// Batch invariance: a token's output depends only on its own x row and the fixed K ranges; the NT = 1 and NT = 2
// builds run the same instructions for tokens 0-7 (the second 8-token tile is separate MMAs), so rows are bitwise
// the same for every M <= 16.
//
// Programmatic dependent launch (compute capability 9.0 and newer, where mma_kernels launches the kernel so): the
// grid may start while the kernel before it in the stream still runs. Until griddepcontrol.wait it reads only the
// weights, which no kernel writes: its rows' first prefetch_sb super-blocks of its K range into L2 (the host
// chooses how many), and with a ring its first stages into shared memory; x, the residual, the partial sums and
// the counts come after the wait. Once its last super-block is done it lets the next kernel launch
// (griddepcontrol.launch_dependents), which then prepares beside this one's stores and split sums. Launched
// plainly, both instructions do nothing.

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float f16_bits_to_f32(u32 bits) {
    float f;
    asm("{ .reg .b16 h; cvt.u16.u32 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(bits));
    return f;
}

// 2**23 + byte j % 4 of `packed`, exactly and without an int-to-float conversion: the byte under the bits of 2**23.
// s * byte is then fmaf(s, byte_magic(...), -s * 2**23): one rounding of the exact s * byte, as s * float(byte).
__device__ __forceinline__ float byte_magic(u32 packed, int j, u32 two23) {
    return __uint_as_float(__byte_perm(packed, two23, 0x7440u | (j & 3)));
}

// v in a register whose value the compiler cannot see (the grid is launched with gridDim.z 1): PRMT takes one
// immediate, and with two constants the compiler materializes the other one again before each use
__device__ __forceinline__ u32 opaque(u32 v) { return v * gridDim.z; }

// bf16 pair {byte 2 (c % 2), byte 2 (c % 2) + 1} of `packed` (bytes below 128), exactly: 128 + byte under the
// exponent of 128.0, less 128
__device__ __forceinline__ u32 byte_pair_bf16(u32 packed, int c) {
    u32 v, p = __byte_perm(packed, 0x43434343u, (c & 1) ? 0x4342u : 0x4140u);
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(v) : "r"(p), "r"(0x3F803F80u), "r"(0xC300C300u));
    return v;
}

// the 8x8 matrix of 16-bit values whose row lane / 4, columns 2 (lane % 4) + 0, 1 this lane holds, transposed
__device__ __forceinline__ u32 transpose8x8(u32 v) {
    u32 t;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(t) : "r"(v));
    return t;
}

// a (low halves) and b (high halves) as three bf16 pairs whose sum is a, b to about 24 bits: hi, mid, lo
__device__ __forceinline__ void split_bf16x3(float a, float b, u32 (&out)[3]) {
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        u32 p;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(b), "f"(a));
        out[part] = p;
        a -= __uint_as_float(p << 16);
        b -= __uint_as_float(p & 0xFFFF0000u);
    }
}

// bf16 bits of v, rounded to nearest even; NaN stays NaN
__device__ __forceinline__ u16 f32_to_bf16_bits(float v) {
    u32 bits = __float_as_uint(v);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (u16)(bits >> 16);
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d = A B + c with c left as it is (one C fragment added to several products without copies)
__device__ __forceinline__ void mma_bf16_16816_c(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1,
                                                 const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// griddepcontrol (the header's last paragraph): wait for the kernels before this one, and let the next one launch
__device__ __forceinline__ void wait_for_earlier_kernels() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_kernel_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// bytes [p, p + n) into L2, widened to 16-byte bounds (a bulk prefetch: one instruction, no registers, no wait)
__device__ __forceinline__ void prefetch_l2(const unsigned char *p, size_t n) {
#if __CUDA_ARCH__ >= 900
    const size_t lo = (size_t)p & ~(size_t)15, hi = ((size_t)p + n + 15) & ~(size_t)15;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(lo), "r"((u32)(hi - lo)) : "memory");
#endif
}

#ifdef R_TILES
#if QTYPE == 4
#define BLOCK_BYTES 144  // d, dmin, 12 bytes of scales and mins, 128 of nibbles
#define QS 16            // where the nibbles start
#elif QTYPE == 5
#define BLOCK_BYTES 176  // d, dmin, scales and mins, 32 bytes of fifth bits (qh), 128 of nibbles
#define QS 48
#elif QTYPE == 6
#define BLOCK_BYTES 208  // lane order: ql and qh as the lanes read them, 16 int8 scales (d at the row's end)
#else
#error "QTYPE must be 4 (Q4_K), 5 (Q5_K) or 6 (Q6_K)"
#endif

// bytes from one weight row to the next: lane-order Q6_K rows hold their d values too, padded to 16 bytes
__device__ __forceinline__ size_t row_stride(int nsb) {
#if QTYPE == 6
    return ((size_t)nsb * 210 + 15) & ~(size_t)15;
#else
    return (size_t)nsb * BLOCK_BYTES;
#endif
}

// Where Q4_K / Q5_K weight row `row`'s super-block sb starts: W + row_offset(row) + sb_offset(sb). In GGUF's order
// (COLUMNS 0) rows lie row_stride apart, a row's super-blocks one after the other. Super-block-major in chunks of
// CHUNK_ROWS rows (COLUMNS 1: Q4_K_COLUMNS, flashdraft.quant.q4k_columns), [N / CHUNK_ROWS][nsb][CHUNK_ROWS]
// [BLOCK_BYTES]: a chunk's super-blocks at one K position lie one after the other, so that the warps, which move
// through K together, read long stretches of memory in order.
#if COLUMNS && QTYPE != 4
#error "only Q4_K comes super-block-major (COLUMNS 1)"
#endif
__device__ __forceinline__ size_t row_offset(int row, int nsb) {
#if COLUMNS
    return (size_t)(row / CHUNK_ROWS) * CHUNK_ROWS * row_stride(nsb) + (size_t)(row % CHUNK_ROWS) * BLOCK_BYTES;
#else
    return (size_t)row * row_stride(nsb);
#endif
}
__device__ __forceinline__ size_t sb_offset(int sb) {
    return (size_t)sb * (COLUMNS ? CHUNK_ROWS : 1) * BLOCK_BYTES;
}

// The tile row (and that row + 8) whose A fragments lane group g holds, and whose sums it stores: g, or in the copy
// engine's ring (rows 144 bytes = 36 words apart) 2 (g % 4) + g / 4, so that the half-warp g = 0-3 reads rows 0, 2,
// 4, 6, 72 words apart: 32 different banks for its 8-byte reads (rows g would meet 2-way conflicts)
#if RING_BULK && !(COLUMNS && STAGES > 0)
#error "the copy engine fills only a ring (STAGES > 0) of Q4_K_COLUMNS"
#endif
__device__ __forceinline__ int frag_row(int g) { return RING_BULK ? 2 * (g & 3) + (g >> 2) : g; }

// The warp's sums at zero, and where this lane reads x: token g + 8 nt's row (a row of zeros past M), from `col`.
__device__ __forceinline__ void start_sums(float (&tot)[R_TILES][NT][4], const u16 *(&xrow)[NT], bool (&xok)[NT],
                                           const u16 *__restrict__ X, int M, int K, int g, int col) {
#pragma unroll
    for (int r = 0; r < R_TILES; ++r)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) tot[r][nt][i] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        int n = g + 8 * nt;
        xok[nt] = n < M;
        xrow[nt] = X + (size_t)(xok[nt] ? n : 0) * K + col;
    }
}

// y rounded to bf16, plus the residual's R[at] where there is one (has_r), rounded again
__device__ __forceinline__ u16 output_bits(float y, const u16 *__restrict__ R, int has_r, size_t at) {
    const u16 bits = f32_to_bf16_bits(y);
    if (!has_r) return bits;
    return f32_to_bf16_bits(__uint_as_float((u32)bits << 16) + __uint_as_float((u32)R[at] << 16));
}

// The warp's sums: rounded to bf16 into Y with one K range; else into this range's partial sums, and, from the
// warp that finishes its rows' last range, every range's sums added in range order and rounded into Y; the
// residual added where there is one.
__device__ __forceinline__ void store_sums(const float (&tot)[R_TILES][NT][4], float *__restrict__ P,
                                           u16 *__restrict__ Y, const u16 *__restrict__ R, int has_r,
                                           unsigned int *__restrict__ C, int M, int N, int tile0, int lane) {
    const int g = lane >> 2, c = lane & 3;
    float *out = P + (size_t)blockIdx.y * M * N;
#pragma unroll
    for (int r = 0; r < R_TILES; ++r) {
        if ((tile0 + r) * 16 >= N) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // C fragment: rows g (i < 2), g + 8; tokens 2c + i % 2
                int token = 8 * nt + 2 * c + (i & 1);
                if (token >= M) continue;
                size_t at = (size_t)token * N + (tile0 + r) * 16 + frag_row(g) + 8 * (i >> 1);
                if (gridDim.y == 1)
                    Y[at] = output_bits(tot[r][nt][i], R, has_r, at);
                else
                    out[at] = tot[r][nt][i];
            }
    }
    if (gridDim.y == 1) return;
    __threadfence();  // this lane's partial sums are visible to every block before its warp is counted
    __syncwarp();
    unsigned int *count = C + tile0 / R_TILES;
    unsigned int before = 0;
    if (lane == 0) before = atomicAdd(count, 1u);
    if (__shfl_sync(0xFFFFFFFFu, before, 0) != gridDim.y - 1) return;
    __syncwarp();     // (a shuffle orders no memory; the warp's barrier does)
    __threadfence();  // the last to count: every range's sums are written
    const int rows = R_TILES * 16;
    for (int idx = lane; idx < rows * M; idx += 32) {  // consecutive lanes, consecutive features of one token
        const int token = idx / rows, n = tile0 * 16 + idx % rows;
        if (n >= N) continue;
        const size_t at = (size_t)token * N + n;
        float v = __ldcg(P + at);  // L2, not this multiprocessor's L1: other blocks wrote them
        for (int s = 1; s < gridDim.y; ++s) v += __ldcg(P + (size_t)s * M * N + at);
        Y[at] = output_bits(v, R, has_r, at);
    }
    if (lane == 0) *count = 0;  // every warp of these rows has counted: ready for the next launch
}

#if STAGES > 0
// bytes per row of a stage: the block padded to 8 or 24 mod 32 words (160 = 40 words, 224 = 56), so that the
// 8-byte reads of rows g = 0-3 at 8c fall on 32 different banks; unpadded in the copy engine's ring (frag_row)
#define ROWB (RING_BULK ? BLOCK_BYTES : QTYPE == 4 ? 160 : 224)
#define STAGE_BYTES (R_TILES * 16 * ROWB)
#define ROW_CHUNKS (BLOCK_BYTES / 16)
#define CHUNKS ((R_TILES * 16 * ROW_CHUNKS + 31) / 32)   // 16-byte copies per lane per super-block

__device__ __forceinline__ void cp_async16(u32 dst, const void *src, bool on) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %2, 0; @p cp.async.cg.shared.global [%0], [%1], 16; }"
                 :: "r"(dst), "l"(src), "r"((int)on));
}
// a shared-memory pointer's address in the shared window, as cp.async, bulk copies and mbarriers take it
__device__ __forceinline__ u32 shared_window(const void *p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_ahead() { asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2)); }
// `bytes` from global src into shared dst by the copy engine, counted into the mbarrier at bar
__device__ __forceinline__ void bulk_copy(u32 dst, const void *src, u32 bytes, u32 bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void wait_phase(u32 bar, u32 parity) {
    asm volatile("{ .reg .pred done; WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;"
                 " @!done bra WAIT_%=; }" :: "r"(bar), "r"(parity) : "memory");
}
#endif  // STAGES > 0

#if QTYPE == 6
#if STAGES > 0
#error "Q6_K takes no shared-memory ring (STAGES 0)"
#endif
// float of the signed byte j % 4 of `packed`, exactly: the byte plus 128 under the bits of 2**23
__device__ __forceinline__ float sbyte_to_f32(u32 packed, int j, u32 two23) {
    return __uint_as_float(__byte_perm(packed ^ 0x80808080u, two23, 0x7440u | (j & 3))) - 8388736.0f;
}
#endif  // QTYPE 6

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
kq_mma(const unsigned char *__restrict__ W, const u16 *__restrict__ X, float *__restrict__ P, u16 *__restrict__ Y,
       const u16 *__restrict__ R, int has_r, unsigned int *__restrict__ C, int M, int N, int nsb, int sb_per_split,
       int prefetch_sb) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int tile0 = (blockIdx.x * WARPS + warp) * R_TILES;
    if (tile0 * 16 >= N) return;
    const int sb0 = blockIdx.y * sb_per_split;
    const int K = nsb * 256;
#if COLUMNS  // a lane a tile's first super-blocks (a tile's 16 rows of one lie together), while earlier kernels run
    for (int i = lane; i < R_TILES * prefetch_sb; i += 32)
        if ((tile0 + i % R_TILES) * 16 < N)
            prefetch_l2(W + sb_offset(sb0 + i / R_TILES) + row_offset((tile0 + i % R_TILES) * 16, nsb),
                        16 * BLOCK_BYTES);
#else
    for (int i = lane; i < R_TILES * 16 && prefetch_sb > 0; i += 32)  // a lane a row, while earlier kernels run
        prefetch_l2(W + (size_t)min(tile0 * 16 + i, N - 1) * row_stride(nsb) + (size_t)sb0 * BLOCK_BYTES,
                    (size_t)prefetch_sb * BLOCK_BYTES);
#endif

    float tot[R_TILES][NT][4];
    const u16 *xrow[NT];
    bool xok[NT];
    start_sums(tot, xrow, xok, X, M, K, g, QTYPE == 6 ? 4 * c : 8 * c);
    const u32 bf16_128 = opaque(0x43434343u), two23 = opaque(0x4B000000u);  // bytes of bf16 128.0, float 2**23
#if QTYPE == 6
    const unsigned char *rowp[R_TILES][2];
#pragma unroll
    for (int r = 0; r < R_TILES; ++r)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            rowp[r][hh] = W + (size_t)min((tile0 + r) * 16 + g + 8 * hh, N - 1) * row_stride(nsb);

    wait_for_earlier_kernels();
    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {
        // Of half n (128 weights) and group gg, this lane's GGUF bytes: ql at 64n + 16gg + 4c (runs 0 and 2, low
        // and high nibbles) and at 64n + 32 + 16gg + 4c (runs 1 and 3), qh at 128 + 32n + 16gg + 4c (run qq: bits
        // 2qq); in lane order word 2n + gg of the 16 bytes at 16c, 64 + 16c and 128 + 16c
        u32 qlo[R_TILES][2][2][2], qhi[R_TILES][2][2][2], qhb[R_TILES][2][2][2], scw[R_TILES][2][4];
        float d[R_TILES][2];
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned char *blk = rowp[r][hh] + (size_t)sb * BLOCK_BYTES;
                const uint4 lo = __ldg((const uint4 *)(blk + 16 * c)), hi = __ldg((const uint4 *)(blk + 64 + 16 * c));
                const uint4 qh = __ldg((const uint4 *)(blk + 128 + 16 * c)), sc = __ldg((const uint4 *)(blk + 192));
                const u32 low[4] = {lo.x, lo.y, lo.z, lo.w}, high[4] = {hi.x, hi.y, hi.z, hi.w};
                const u32 bits[4] = {qh.x, qh.y, qh.z, qh.w};
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    qlo[r][hh][w >> 1][w & 1] = low[w];
                    qhi[r][hh][w >> 1][w & 1] = high[w];
                    qhb[r][hh][w >> 1][w & 1] = bits[w];
                }
                scw[r][hh][0] = sc.x;  // scales 4i .. 4i + 3
                scw[r][hh][1] = sc.y;
                scw[r][hh][2] = sc.z;
                scw[r][hh][3] = sc.w;
                d[r][hh] = f16_bits_to_f32(__ldg((const u16 *)(rowp[r][hh] + (size_t)nsb * BLOCK_BYTES) + sb));
            }
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int qq = 0; qq < 4; ++qq)
#pragma unroll
                for (int gg = 0; gg < 2; ++gg) {  // one MMA k-step: the 16 weights of group 8n + 2qq + gg
                    const int grp = 8 * n + 2 * qq + gg;
                    uint2 xv[NT];
                    // -160 sum(x) over the group (products exact, fp32 sums) for tokens 8nt + 2c + (i & 1), in the
                    // C layout of the weights' MMAs (A all -160: every row alike), which add it as their C
                    float offs[NT][4];
                    const float zeros[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        xv[nt] = xok[nt] ? __ldg((const uint2 *)(xrow[nt] + sb * 256 + 16 * grp)) : make_uint2(0, 0);
                        mma_bf16_16816_c(offs[nt], 0xC320C320u, 0xC320C320u, 0xC320C320u, 0xC320C320u, xv[nt].x,
                                         xv[nt].y, zeros);
                    }
#pragma unroll
                    for (int r = 0; r < R_TILES; ++r) {
                        u32 t[2];
                        float dl[2];
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            u32 lo = (qq & 1) ? qhi[r][hh][n][gg] : qlo[r][hh][n][gg];
                            t[hh] = (((qq & 2) ? (lo >> 4) : lo) & 0x0F0F0F0Fu)
                                    | (((qhb[r][hh][n][gg] >> (2 * qq)) & 0x03030303u) << 4);
                            dl[hh] = d[r][hh] * sbyte_to_f32(scw[r][hh][grp >> 2], grp, two23);
                        }
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            float acc[4];  // sum(x (128 + q)) - 160 sum(x) = sum(x (q - 32))
                            mma_bf16_16816_c(acc, __byte_perm(t[0], bf16_128, 0x4140),
                                             __byte_perm(t[1], bf16_128, 0x4140),
                                             __byte_perm(t[0], bf16_128, 0x4342),
                                             __byte_perm(t[1], bf16_128, 0x4342), xv[nt].x, xv[nt].y, offs[nt]);
#pragma unroll
                            for (int i = 0; i < 4; ++i)  // d sc sum(x (q - 32))
                                tot[r][nt][i] = fmaf(dl[i >> 1], acc[i], tot[r][nt][i]);
                        }
                    }
                }
    }
#else  // Q4_K, Q5_K
#if STAGES == 0
    const unsigned char *rowp[R_TILES][2];
#pragma unroll
    for (int r = 0; r < R_TILES; ++r)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            rowp[r][hh] = W + row_offset(min((tile0 + r) * 16 + g + 8 * hh, N - 1), nsb);
#endif

#if STAGES > 0
    // this lane's 16-byte copies of a super-block: chunk i = lane + 32 t of the warp's rows' 9 chunks each
    extern __shared__ uint4 smem[];
    const unsigned char *ring = (const unsigned char *)smem + warp * STAGES * STAGE_BYTES;
    const u32 ring_addr = shared_window(ring);  // for cp.async
    const int sb_end = sb0 + sb_per_split;
#if RING_BULK  // the warp's rows at a super-block: one run, from row_offset(tile0 * 16) on (COLUMNS)
    __shared__ __align__(8) unsigned long long full[WARPS][STAGES];
    const u32 full_addr = shared_window(&full[warp][0]);  // the warp's mbarriers, one a stage, 8 bytes apart
    const unsigned char *run = W + row_offset(tile0 * 16, nsb);
    if (lane == 0) {
        for (int s = 0; s < STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full_addr + 8 * s) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < STAGES - 1 && sb0 + s < sb_end; ++s)
            bulk_copy(ring_addr + s * STAGE_BYTES, run + sb_offset(sb0 + s), STAGE_BYTES, full_addr + 8 * s);
    }
    __syncwarp();
#else
    const unsigned char *csrc[CHUNKS];
    u32 cdst[CHUNKS];
    bool con[CHUNKS];
#pragma unroll
    for (int t = 0; t < CHUNKS; ++t) {
        const int i = lane + 32 * t, row = i / ROW_CHUNKS, col = i % ROW_CHUNKS;
        con[t] = i < R_TILES * 16 * ROW_CHUNKS;
        csrc[t] = W + row_offset(min(tile0 * 16 + (con[t] ? row : 0), N - 1), nsb) + 16 * col;
        cdst[t] = ring_addr + row * ROWB + 16 * col;
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
#pragma unroll
        for (int t = 0; t < CHUNKS; ++t)
            cp_async16(cdst[t] + s * STAGE_BYTES, csrc[t] + sb_offset(sb0 + s),
                       con[t] && sb0 + s < sb_end);
        cp_async_commit();
    }
#endif  // RING_BULK
#endif  // STAGES > 0
    wait_for_earlier_kernels();
    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {
        uint4 hdr[R_TILES][2];
        uint2 q[R_TILES][2][4];
#if QTYPE == 5
        uint2 qh[R_TILES][2];  // bit j of byte i: the fifth bit of position i (of 32) of sub-block j
#endif
#if STAGES > 0
        const int stage = (sb - sb0) % STAGES, ahead = sb + STAGES - 1, slot = (stage + STAGES - 1) % STAGES;
#if RING_BULK
        wait_phase(full_addr + 8 * stage, ((sb - sb0) / STAGES) & 1);  // this super-block's bytes have landed
        __syncwarp();  // every lane is done with the stage refilled next
        if (lane == 0 && ahead < sb_end) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the lanes' reads before the copy's writes
            bulk_copy(ring_addr + slot * STAGE_BYTES, run + sb_offset(ahead), STAGE_BYTES, full_addr + 8 * slot);
        }
#else
        cp_async_wait_ahead();  // this super-block's copies (this lane's) are done
        __syncwarp();           // and every lane's; and every lane is done with the stage refilled next
#pragma unroll
        for (int t = 0; t < CHUNKS; ++t)
            cp_async16(cdst[t] + slot * STAGE_BYTES, csrc[t] + sb_offset(ahead), con[t] && ahead < sb_end);
        cp_async_commit();
#endif
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned char *blk = ring + stage * STAGE_BYTES + (r * 16 + frag_row(g) + 8 * hh) * ROWB;
                hdr[r][hh] = *(const uint4 *)blk;
#if QTYPE == 5
                qh[r][hh] = *(const uint2 *)(blk + 16 + 8 * c);
#endif
#pragma unroll
                for (int gq = 0; gq < 4; ++gq) q[r][hh][gq] = *(const uint2 *)(blk + QS + 32 * gq + 8 * c);
            }
#else
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned char *blk = rowp[r][hh] + sb_offset(sb);
                hdr[r][hh] = __ldg((const uint4 *)blk);
#if QTYPE == 5
                qh[r][hh] = __ldg((const uint2 *)(blk + 16 + 8 * c));
#endif
#pragma unroll
                for (int gq = 0; gq < 4; ++gq) q[r][hh][gq] = __ldg((const uint2 *)(blk + QS + 32 * gq + 8 * c));
            }
#endif
        // d, dmin, and the 6-bit scales and mins of the 8 sub-blocks one per byte ([0]: sub-blocks 0-3, [1]: 4-7)
        float d[R_TILES][2], dmin[R_TILES][2], d_off[R_TILES][2];  // d_off: -2**23 d
        u32 scp[R_TILES][2][2], mnp[R_TILES][2][2];
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                uint4 h = hdr[r][hh];
                d[r][hh] = f16_bits_to_f32(h.x & 0xFFFF);
                dmin[r][hh] = f16_bits_to_f32(h.x >> 16);
                d_off[r][hh] = -8388608.0f * d[r][hh];
                scp[r][hh][0] = h.y & 0x3F3F3F3Fu;
                mnp[r][hh][0] = h.z & 0x3F3F3F3Fu;
                scp[r][hh][1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
                mnp[r][hh][1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
            }
        // sum(x_j) of tokens 8 nt + 2c, 8 nt + 2c + 1 in row j = g ([0], [1]) of xsum[nt]: the C of an MMA whose A
        // selects sub-block j into row j (rows 8-15 stay zero) and whose B is x
        float xsum[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) xsum[nt][i] = 0.0f;
#pragma unroll
        for (int gq = 0; gq < 4; ++gq) {  // the 32 bytes gq hold sub-blocks 2gq (low nibbles) and 2gq + 1 (high)
            uint4 xv[NT][2];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    xv[nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + sb * 256 + 32 * (2 * gq + h)))
                                        : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * gq + h;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    float ones[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                    for (int s = 0; s < 2; ++s)
                        mma_bf16_16816(ones, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u,
                                       s ? xv[nt][h].z : xv[nt][h].x, s ? xv[nt][h].w : xv[nt][h].y);
                    if (g == j) {
                        xsum[nt][0] = ones[0];
                        xsum[nt][1] = ones[1];
                    }
                }
#pragma unroll
                for (int r = 0; r < R_TILES; ++r) {
                    float dl[2];
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
                        dl[hh] = fmaf(d[r][hh], byte_magic(scp[r][hh][j >> 2], j, two23), d_off[r][hh]);  // d sc
                    float acc[NT][4];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
#pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        u32 w0 = s ? q[r][0][gq].y : q[r][0][gq].x;  // row g
                        u32 w1 = s ? q[r][1][gq].y : q[r][1][gq].x;  // row g + 8
                        u32 t0 = (h ? (w0 >> 4) : w0) & 0x0F0F0F0Fu;
                        u32 t1 = (h ? (w1 >> 4) : w1) & 0x0F0F0F0Fu;
#if QTYPE == 5
                        t0 |= (((s ? qh[r][0].y : qh[r][0].x) >> j) & 0x01010101u) << 4;
                        t1 |= (((s ? qh[r][1].y : qh[r][1].x) >> j) & 0x01010101u) << 4;
#endif
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
                            mma_bf16_16816(acc[nt], __byte_perm(t0, bf16_128, 0x4140),
                                           __byte_perm(t1, bf16_128, 0x4140),
                                           __byte_perm(t0, bf16_128, 0x4342),
                                           __byte_perm(t1, bf16_128, 0x4342),
                                           s ? xv[nt][h].z : xv[nt][h].x, s ? xv[nt][h].w : xv[nt][h].y);
                    }
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int i = 0; i < 4; ++i)  // C fragment: rows g (i < 2), g + 8; tokens 2c + i % 2
                            tot[r][nt][i] = fmaf(acc[nt][i], dl[i >> 1], tot[r][nt][i]);
                }
            }
        }
        // The super-block's - sum over j of (128 d sc_j + dmin m_j) sum(x_j), as MMAs over its 8 sub-blocks:
        // A = the 6-bit scales or mins of rows g, g + 8 at k 2c, 2c + 1 (again at 2c + 8, 2c + 9), B = the sums of x
        // as bf16 hi, mid (k + 8) and lo parts, transposed to B's layout (sub-blocks 2c, 2c + 1 of token g): the
        // sums to about 24 bits, the products exact, fp32 sums.
        u32 xs3[NT][3];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            split_bf16x3(xsum[nt][0], xsum[nt][1], xs3[nt]);
#pragma unroll
            for (int part = 0; part < 3; ++part) xs3[nt][part] = transpose8x8(xs3[nt][part]);
        }
#pragma unroll
        for (int r = 0; r < R_TILES; ++r) {
            u32 am[2], asc[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {  // sub-blocks 2c, 2c + 1: bytes of word c / 2
                am[hh] = byte_pair_bf16((c & 2) ? mnp[r][hh][1] : mnp[r][hh][0], c);
                asc[hh] = byte_pair_bf16((c & 2) ? scp[r][hh][1] : scp[r][hh][0], c);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float cm[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_bf16_16816(cm, am[0], am[1], am[0], am[1], xs3[nt][0], xs3[nt][1]);
                mma_bf16_16816(cm, am[0], am[1], am[0], am[1], xs3[nt][2], 0u);
                mma_bf16_16816(cs, asc[0], asc[1], asc[0], asc[1], xs3[nt][0], xs3[nt][1]);
                mma_bf16_16816(cs, asc[0], asc[1], asc[0], asc[1], xs3[nt][2], 0u);
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    tot[r][nt][i] = fmaf(-dmin[r][i >> 1], cm[i], fmaf(-128.0f * d[r][i >> 1], cs[i], tot[r][nt][i]));
            }
        }
    }
#endif  // QTYPE
    let_next_kernel_launch();
    store_sums(tot, P, Y, R, has_r, C, M, N, tile0, lane);
}
#endif  // R_TILES
