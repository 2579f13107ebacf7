// Issue #18 lab: Q4_K matrix times 1-16 rows of x with mma.sync, no shared memory. The lab copy of
// src/flashdraft/quant/q4k_mma.cu, with one more option: `tiled` blocks ([N / 16][K / 256][16][144], a tile's 16 rows
// of a super-block contiguous), measured 3-15% faster than the row-major blocks the engine keeps (docs/performance.md).
// Compiled at run time by NVRTC (torch.cuda._compile_kernel) with R_TILES, NT, WARPS, MINB defined in front.
//
// Each warp owns R_TILES tiles of 16 weight rows and one K range (a split). Per 32-weight sub-block, the tensor
// cores form s = x . (128 + q) for NT tiles of 8 tokens (exact bf16 operands, fp32 sums); the warp then adds
// d sc s - (128 d sc + dmin m) sum(x) per row and token. Lane (g = lane / 4, c = lane % 4) reads, of rows g and
// g + 8 of a tile, the 8 bytes at 8c of each 32-byte run, and x[token][32 j + 8c .. + 7]: with the sub-block's
// positions p read as MMA k = 16 (p % 8 / 4) + ... (p = 8c + 4s + e: k-step s, k = 2c + e for e < 2, 2c + 8 + e - 2
// otherwise), both operands' fragments are those loads, unpermuted.

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float f16_bits_to_f32(u32 bits) {
    float f;
    asm("{ .reg .b16 h; cvt.u16.u32 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(bits));
    return f;
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ const unsigned char *q4k_block(const unsigned char *W, int row, int sb, int nsb,
                                                          int tiled) {
    if (tiled)  // [N / 16][nsb][16][144]: a tile's 16 rows of one super-block are contiguous
        return W + ((size_t)((row >> 4) * nsb + sb) * 16 + (row & 15)) * 144;
    return W + ((size_t)row * nsb + sb) * 144;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
q4k_mma(const unsigned char *__restrict__ W, const u16 *__restrict__ X, float *__restrict__ P, int M, int N,
        int nsb, int sb_per_split, int tiled) {
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
    int rows[R_TILES][2];
#pragma unroll
    for (int r = 0; r < R_TILES; ++r) {
        int base = (tile0 + r) * 16;
        rows[r][0] = min(base + g, N - 1);
        rows[r][1] = min(base + g + 8, N - 1);
    }

    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {
        uint4 hdr[R_TILES][2];
        uint2 q[R_TILES][2][4];
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned char *blk = q4k_block(W, rows[r][hh], sb, nsb, tiled);
                hdr[r][hh] = __ldg((const uint4 *)blk);
#pragma unroll
                for (int gq = 0; gq < 4; ++gq) q[r][hh][gq] = __ldg((const uint2 *)(blk + 16 + 32 * gq + 8 * c));
            }
        float d[R_TILES][2], dmin[R_TILES][2];
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                d[r][hh] = f16_bits_to_f32(hdr[r][hh].x & 0xFFFF);
                dmin[r][hh] = f16_bits_to_f32(hdr[r][hh].x >> 16);
            }
        // the 6-bit scales and mins of the 8 sub-blocks, one per byte: sc[0] = sub-blocks 0-3, sc[1] = 4-7
        u32 scp[R_TILES][2][2], mnp[R_TILES][2][2];
#pragma unroll
        for (int r = 0; r < R_TILES; ++r)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                uint4 h = hdr[r][hh];
                scp[r][hh][0] = h.y & 0x3F3F3F3Fu;
                mnp[r][hh][0] = h.z & 0x3F3F3F3Fu;
                scp[r][hh][1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
                mnp[r][hh][1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
            }
#pragma unroll
        for (int gq = 0; gq < 4; ++gq) {
            uint4 xv[NT][2];
            float xs[NT][2][2];  // sum of x over sub-block 2gq + h for tokens 8nt + 2c + i (C-fragment columns)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    int j = 2 * gq + h;
                    xv[nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + sb * 256 + 32 * j))
                                        : make_uint4(0, 0, 0, 0);
                    float ones[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // x . 1 on the tensor cores: every row the sum
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
                    const u32 sel = 0x7440u | (j & 3);  // byte j % 4 under the float bits of 2**23
                    float dl[2], corr[2];
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        float sc = __uint_as_float(__byte_perm(scp[r][hh][j >> 2], 0x4B000000u, sel)) - 8388608.0f;
                        float mn = __uint_as_float(__byte_perm(mnp[r][hh][j >> 2], 0x4B000000u, sel)) - 8388608.0f;
                        dl[hh] = d[r][hh] * sc;
                        corr[hh] = fmaf(128.0f, dl[hh], dmin[r][hh] * mn);
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
                        u32 a0 = __byte_perm(t0, 0x43434343u, 0x4140);  // row g, k 2c, 2c + 1: bf16 128 + q
                        u32 a1 = __byte_perm(t1, 0x43434343u, 0x4140);  // row g + 8
                        u32 a2 = __byte_perm(t0, 0x43434343u, 0x4342);  // row g, k 2c + 8, 2c + 9
                        u32 a3 = __byte_perm(t1, 0x43434343u, 0x4342);
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            u32 b0 = s ? xv[nt][h].z : xv[nt][h].x;
                            u32 b1 = s ? xv[nt][h].w : xv[nt][h].y;
                            mma_bf16_16816(acc[nt], a0, a1, a2, a3, b0, b1);
                        }
                    }
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            int hh = i >> 1;
                            float t = fmaf(acc[nt][i], dl[hh], tot[r][nt][i]);
                            tot[r][nt][i] = fmaf(-corr[hh], xs[nt][h][i & 1], t);
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
                int row = (tile0 + r) * 16 + g + 8 * (i >> 1);
                if (token < M) out[(size_t)token * N + row] = tot[r][nt][i];
            }
    }
}

// y[m][n] = bf16(p[0][m][n] + p[1][m][n] + ...), always in split order.
extern "C" __global__ void q_split_reduce(const float *__restrict__ P, u16 *__restrict__ Y, int split, int M, int N) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= M * N) return;
    float v = P[idx];
    for (int s = 1; s < split; ++s) v += P[(size_t)s * M * N + idx];
    u32 bits = __float_as_uint(v);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    Y[idx] = (u16)(bits >> 16);
}
