"""Triton matmul kernels that read GGUF blocks directly (CUDA only; imported by flashdraft.quant.linear on CUDA).

y[M, N] = x[M, K] @ W^T with W held as uint8 blocks [N, row_bytes]. Each program decodes a [BLOCK_N, BLOCK_K]
tile of W to float32 (the same formulas as flashdraft.quant.dequant), casts it to the activation dtype and
feeds tensor cores with tl.dot. The tiling is fixed (no autotuning, no split-K, no atomics) and every M-tile
runs the same instruction sequence, so a token's output row is bitwise the same whether 1 or 16 tokens go
through: plain decoding and DFlash verify agree. BLOCK_M = 16 covers a whole verify block in one M-tile, so
the weight bytes are read once for M <= 16 and the cost stays nearly flat from 1 to 16 tokens.

This is the simple first version (element-wise byte gathers served by L1); it is correct and batch-invariant,
not yet bandwidth-optimal (see docs/gguf.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

QTYPE_CODES = {"Q4_0": 0, "Q5_0": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 16, 64, 64, 4


@triton.jit
def _fp16_at(ptr, valid):
    """Little-endian fp16 at ptr -> float32 (0 where masked)."""
    bits = (tl.load(ptr + 1, mask=valid, other=0).to(tl.uint16) << 8) | tl.load(ptr, mask=valid, other=0).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte_at(ptr, valid):
    return tl.load(ptr, mask=valid, other=0).to(tl.int32)


@triton.jit
def _legacy_32(row, k, valid, BLOCK_BYTES: tl.constexpr, QS_OFFSET: tl.constexpr, HIGH_BITS: tl.constexpr,
               SIGNED_BYTES: tl.constexpr):
    """Q4_0 (d*(q-8)), Q5_0 (d*(q-16), 4 bytes of 5th bits) and Q8_0 (d*int8) blocks of 32 weights."""
    base = row + (k // 32) * BLOCK_BYTES
    e = k % 32
    d = _fp16_at(base, valid)
    if SIGNED_BYTES:
        w = tl.load(base + 2 + e, mask=valid, other=0).to(tl.int8, bitcast=True).to(tl.float32) * d
    else:
        q = (_byte_at(base + QS_OFFSET + e % 16, valid) >> (4 * (e // 16))) & 0x0F
        if HIGH_BITS:
            q = (q | (((_byte_at(base + 2 + e // 8, valid) >> (e % 8)) & 1) << 4)) - 16
        else:
            q = q - 8
        w = d * q.to(tl.float32)
    return w


@triton.jit
def _q6_k(row, k, valid):
    """Q6_K super-block: ql[128] qh[64] int8 scales[16] fp16 d; weight = (d * s_j) * (q - 32)."""
    base = row + (k // 256) * 210
    e = k % 256
    h, r = e // 128, e % 128
    lo = (_byte_at(base + h * 64 + r % 64, valid) >> (4 * (r // 64))) & 0x0F
    hi = (_byte_at(base + 128 + h * 32 + r % 32, valid) >> (2 * (r // 32))) & 0x03
    sc = tl.load(base + 192 + e // 16, mask=valid, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return (_fp16_at(base + 208, valid) * sc) * ((lo | (hi << 4)) - 32).to(tl.float32)


@triton.jit
def _q45_k(row, k, valid, FIVE_BIT: tl.constexpr):
    """Q4_K / Q5_K super-block: d, dmin, 12 packed 6-bit scale/min bytes, [Q5_K: 32 bytes of 5th bits], nibbles."""
    if FIVE_BIT:
        base = row + (k // 256) * 176
        qs = base + 48
    else:
        base = row + (k // 256) * 144
        qs = base + 16
    e = k % 256
    j, i = e // 32, e % 32
    q = (_byte_at(qs + 32 * (j // 2) + i, valid) >> (4 * (j % 2))) & 0x0F
    if FIVE_BIT:
        q = q | (((_byte_at(base + 16 + i, valid) >> j) & 1) << 4)
    sc_lo = _byte_at(base + 4 + j % 4, valid)
    mn_lo = _byte_at(base + 8 + j % 4, valid)
    hi = _byte_at(base + 12 + j % 4, valid)
    sc = tl.where(j < 4, sc_lo & 0x3F, (hi & 0x0F) | ((sc_lo >> 6) << 4)).to(tl.float32)
    mn = tl.where(j < 4, mn_lo & 0x3F, (hi >> 4) | ((mn_lo >> 6) << 4)).to(tl.float32)
    return (_fp16_at(base, valid) * sc) * q.to(tl.float32) - _fp16_at(base + 2, valid) * mn


@triton.jit
def _decode_tile(w_ptr, rn, rk, row_bytes, valid, QTYPE: tl.constexpr):
    """Weights W[rn, rk] as float32 [BLOCK_N, BLOCK_K]; `valid` masks rows/columns outside the matrix."""
    row = w_ptr + rn[:, None].to(tl.int64) * row_bytes
    k = rk[None, :]
    if QTYPE == 0:
        w = _legacy_32(row, k, valid, 18, 2, False, False)
    elif QTYPE == 1:
        w = _legacy_32(row, k, valid, 22, 6, True, False)
    elif QTYPE == 2:
        w = _legacy_32(row, k, valid, 34, 2, False, True)
    elif QTYPE == 3:
        w = _q45_k(row, k, valid, False)
    elif QTYPE == 4:
        w = _q45_k(row, k, valid, True)
    else:
        w = _q6_k(row, k, valid)
    return tl.where(valid, w, 0.0)


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                         QTYPE: tl.constexpr, FP32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        valid = (rn[:, None] < N) & (rk[None, :] < K)
        w = _decode_tile(w_ptr, rn, rk, row_bytes, valid, QTYPE)
        if FP32:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _matmul(qtype: str):
    code = QTYPE_CODES[qtype]

    def matmul(x: torch.Tensor, blocks: torch.Tensor, out_features: int) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()
        m = x2.shape[0]
        y = torch.empty((m, out_features), dtype=x.dtype, device=x.device)
        if m:
            grid = (triton.cdiv(out_features, BLOCK_N), triton.cdiv(m, BLOCK_M))
            _quant_matmul_kernel[grid](x2, blocks, y, m, out_features, k, blocks.shape[1], x2.stride(0), y.stride(0),
                                       QTYPE=code, FP32=x.dtype == torch.float32,
                                       BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
        return y.reshape(*lead, out_features)

    return matmul


KERNELS = {name: _matmul(name) for name in QTYPE_CODES}
