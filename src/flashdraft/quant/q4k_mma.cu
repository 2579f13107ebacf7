// Q4_K weights times 1-16 rows of bf16 x on the tensor cores, from register fragments (no block barriers).
// Compiled at first use by NVRTC (flashdraft.quant.mma_kernels): q4k_mma with R_TILES, NT, WARPS, MINB and STAGES
// defined in front of this text, once per tiling; q_split_reduce, which depends on none of them, without.
//
// W: GGUF Q4_K blocks, row-major uint8 [N, K / 256 * 144]. X: bf16 [M, K], M <= 8 * NT. P: float32 partial sums
// [split, M, N], one K range (a split) each, added in split order by q_split_reduce; with one K range (gridDim.y
// 1) the kernel rounds its sums to bf16 into Y [M, N] itself, as q_split_reduce would, and P is not touched.
//
// Each warp owns R_TILES tiles of 16 weight rows and one K range. Per 32-weight sub-block j of a super-block the
// tensor cores form s = x . (128 + q) for NT tiles of 8 tokens (bf16 128 + q is exact, so are the products; fp32
// sums), and x . 1 (the ones-MMA: every row of its output is sum(x_j)); the warp then adds
// d sc_j s - (128 d sc_j + dmin m_j) sum(x_j) = sum over the sub-block of x (d sc_j q - dmin m_j), gguf's weight,
// per row and token, in fp32. The weights are never rounded: only the products' sums are.
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
// the one it computes: more bytes in flight per multiprocessor without more registers. Rows sit 160 bytes apart
// there (144 padded), so the fragment reads of a half-warp hit 32 different banks. Same arithmetic either way.
//
// Batch invariance: a token's output depends only on its own x row and the fixed K ranges; the NT = 1 and NT = 2
// builds run the same instructions for tokens 0-7 (the second 8-token tile is separate MMAs), so rows are bitwise
// the same for every M <= 16.

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float f16_bits_to_f32(u32 bits) {
    float f;
    asm("{ .reg .b16 h; cvt.u16.u32 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(bits));
    return f;
}

// float of byte j % 4 of `packed`, exactly and without an int-to-float conversion: the byte under the bits of 2**23
__device__ __forceinline__ float byte_to_f32(u32 packed, int j) {
    return __uint_as_float(__byte_perm(packed, 0x4B000000u, 0x7440u | (j & 3))) - 8388608.0f;
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

#ifdef R_TILES
#if STAGES > 0
#define ROWB 160                                  // bytes per row of a stage: 144 and 16 of padding
#define STAGE_BYTES (R_TILES * 16 * ROWB)
#define CHUNKS ((R_TILES * 16 * 9 + 31) / 32)   // 16-byte copies per lane per super-block

__device__ __forceinline__ void cp_async16(u32 dst, const void *src, bool on) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %2, 0; @p cp.async.cg.shared.global [%0], [%1], 16; }"
                 :: "r"(dst), "l"(src), "r"((int)on));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_ahead() { asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2)); }
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
q4k_mma(const unsigned char *__restrict__ W, const u16 *__restrict__ X, float *__restrict__ P, u16 *__restrict__ Y,
        int M, int N, int nsb, int sb_per_split) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int tile0 = (blockIdx.x * WARPS + warp) * R_TILES;
    if (tile0 * 16 >= N) return;
    const int sb0 = blockIdx.y * sb_per_split;
    const int K = nsb * 256;

    float tot[R_TILES][NT][4];
#pragma unroll
    for (int r = 0; r < R_TILES; ++r)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) tot[r][nt][i] = 0.0f;
    const u16 *xrow[NT];
    bool xok[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        int n = g + 8 * nt;
        xok[nt] = n < M;
        xrow[nt] = X + (size_t)(xok[nt] ? n : 0) * K + 8 * c;
    }
#if STAGES == 0
    const unsigned char *rowp[R_TILES][2];
#pragma unroll
    for (int r = 0; r < R_TILES; ++r)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            rowp[r][hh] = W + (size_t)min((tile0 + r) * 16 + g + 8 * hh, N - 1) * nsb * 144;
#endif

#if STAGES > 0
    // this lane's 16-byte copies of a super-block: chunk i = lane + 32 t of the warp's rows' 9 chunks each
    extern __shared__ uint4 smem[];
    const unsigned char *ring = (const unsigned char *)smem + warp * STAGES * STAGE_BYTES;
    u32 ring_addr;  // its shared-window address, for cp.async
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(ring_addr) : "l"(ring));
    const unsigned char *csrc[CHUNKS];
    u32 cdst[CHUNKS];
    bool con[CHUNKS];
#pragma unroll
    for (int t = 0; t < CHUNKS; ++t) {
        const int i = lane + 32 * t, row = i / 9, col = i % 9;
        con[t] = i < R_TILES * 16 * 9;
        csrc[t] = W + (size_t)min(tile0 * 16 + (con[t] ? row : 0), N - 1) * nsb * 144 + 16 * col;
        cdst[t] = ring_addr + row * ROWB + 16 * col;
    }
    const int sb_end = sb0 + sb_per_split;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
#pragma unroll
        for (int t = 0; t < CHUNKS; ++t)
            cp_async16(cdst[t] + s * STAGE_BYTES, csrc[t] + (size_t)(sb0 + s) * 144, con[t] && sb0 + s < sb_end);
        cp_async_commit();
    }
#endif
    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {
        uint4 hdr[R_TILES][2];
        uint2 q[R_TILES][2][4];
#if STAGES > 0
        const int stage = (sb - sb0) % STAGES;
        cp_async_wait_ahead();  // this super-block's copies (this lane's) are done
        __syncwarp();           // and every lane's; and every lane is done with the stage refilled next
        {
            const int ahead = sb + STAGES - 1, slot = (stage + STAGES - 1) % STAGES;
#pragma unroll
            for (int t = 0; t < CHUNKS; ++t)
                cp_async16(cdst[t] + slot * STAGE_BYTES, csrc[t] + (size_t)ahead * 144, con[t] && ahead < sb_end);
            cp_async_commit();
        }
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned char *blk = ring + stage * STAGE_BYTES + (r * 16 + g + 8 * hh) * ROWB;
                hdr[r][hh] = *(const uint4 *)blk;
#pragma unroll
                for (int gq = 0; gq < 4; ++gq) q[r][hh][gq] = *(const uint2 *)(blk + 16 + 32 * gq + 8 * c);
            }
#else
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned char *blk = rowp[r][hh] + sb * 144;
                hdr[r][hh] = __ldg((const uint4 *)blk);
#pragma unroll
                for (int gq = 0; gq < 4; ++gq) q[r][hh][gq] = __ldg((const uint2 *)(blk + 16 + 32 * gq + 8 * c));
            }
#endif
        // d, dmin, and the 6-bit scales and mins of the 8 sub-blocks one per byte ([0]: sub-blocks 0-3, [1]: 4-7)
        float d[R_TILES][2], dmin[R_TILES][2];
        u32 scp[R_TILES][2][2], mnp[R_TILES][2][2];
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                uint4 h = hdr[r][hh];
                d[r][hh] = f16_bits_to_f32(h.x & 0xFFFF);
                dmin[r][hh] = f16_bits_to_f32(h.x >> 16);
                scp[r][hh][0] = h.y & 0x3F3F3F3Fu;
                mnp[r][hh][0] = h.z & 0x3F3F3F3Fu;
                scp[r][hh][1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
                mnp[r][hh][1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
            }
#pragma unroll
        for (int gq = 0; gq < 4; ++gq) {  // the 32 bytes gq hold sub-blocks 2gq (low nibbles) and 2gq + 1 (high)
            uint4 xv[NT][2];
            float xs[NT][2][2];  // sum(x) over sub-block 2gq + h for tokens 8nt + 2c + i (the C fragment's columns)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    xv[nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + sb * 256 + 32 * (2 * gq + h)))
                                        : make_uint4(0, 0, 0, 0);
                    float ones[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_bf16_16816(ones, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, xv[nt][h].x, xv[nt][h].y);
                    mma_bf16_16816(ones, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, xv[nt][h].z, xv[nt][h].w);
                    xs[nt][h][0] = ones[0];
                    xs[nt][h][1] = ones[1];
                }
#pragma unroll
            for (int r = 0; r < R_TILES; ++r)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int j = 2 * gq + h;
                    float dl[2], corr[2];
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        dl[hh] = d[r][hh] * byte_to_f32(scp[r][hh][j >> 2], j);
                        corr[hh] = fmaf(128.0f, dl[hh], dmin[r][hh] * byte_to_f32(mnp[r][hh][j >> 2], j));
                    }
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
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
                            mma_bf16_16816(acc[nt], __byte_perm(t0, 0x43434343u, 0x4140),
                                           __byte_perm(t1, 0x43434343u, 0x4140),
                                           __byte_perm(t0, 0x43434343u, 0x4342),
                                           __byte_perm(t1, 0x43434343u, 0x4342),
                                           s ? xv[nt][h].z : xv[nt][h].x, s ? xv[nt][h].w : xv[nt][h].y);
                    }
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {  // C fragment: rows g (i < 2), g + 8; tokens 2c + i % 2
                            float t = fmaf(acc[nt][i], dl[i >> 1], tot[r][nt][i]);
                            tot[r][nt][i] = fmaf(-corr[i >> 1], xs[nt][h][i & 1], t);
                        }
                }
        }
    }
    float *out = P + (size_t)blockIdx.y * M * N;
#pragma unroll
    for (int r = 0; r < R_TILES; ++r) {
        if ((tile0 + r) * 16 >= N) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int token = 8 * nt + 2 * c + (i & 1);
                if (token >= M) continue;
                size_t at = (size_t)token * N + (tile0 + r) * 16 + g + 8 * (i >> 1);
                if (gridDim.y == 1)
                    Y[at] = f32_to_bf16_bits(tot[r][nt][i]);
                else
                    out[at] = tot[r][nt][i];
            }
    }
}
#endif

// y[m][n] = bf16(p[0][m][n] + p[1][m][n] + ...), always in split order.
extern "C" __global__ void q_split_reduce(const float *__restrict__ P, u16 *__restrict__ Y, int split, int MN) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= MN) return;
    float v = P[idx];
    for (int s = 1; s < split; ++s) v += P[(size_t)s * MN + idx];
    Y[idx] = f32_to_bf16_bits(v);
}
