"""Issue #18 lab: where does a Q4_K matmul for 1-16 rows spend its time on the H200, and which formulation
streams the weights fastest? Times each candidate kernel on the Gemma-4-31B Q4_K shapes (random valid blocks,
weight copies that defeat the L2, one CUDA graph per candidate), checks it against dequantize + matmul and for
bitwise batch invariance (rows at M = 1 equal those at M = 16), and prints one table.

Candidates:
- `adopted`: flashdraft.kernels.gguf_triton.launch as it stands (decode each weight to fp32 with its scale and
  min, cast to bf16, tl.dot; x permuted once per call).
- `load`: the same bytes read in the factored kernel's pattern, with only a byte sum (the memory ceiling of that
  access pattern under Triton).
- `fact`: factored scales. Per 32-weight sub-block j the kernel forms bf16 (128 + q) by OR-ing the nibble into the
  bits of 128.0 (exact, no int-to-float conversion), takes s_j = x_j . (128 + q) with the tensor cores (fp32), and
  adds d sc_j s_j - (128 d sc_j + dmin m_j) sum(x_j): per weight one mask, one OR and the products; the scales
  apply once per sub-block and row instead of once per weight. x is read in K order (no permutation).
- `fact_a`: the same with the weights as the dot's first operand ([BLOCK_N, 32] x [32, 16]).
- `int8`: x quantized per 32 values to int8 (as llama.cpp's q8_1; the quantization itself is not timed here), the
  nibbles as int8, integer tensor-core dots (exact int32 sub-block sums), scales in fp32.

Usage: PYTHONPATH=src python scripts/gpu/q4k_lab.py OUT [--tiny] [--only NAMES] [--ncu]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_run import bench_ms, copies_for, random_blocks, rel_err  # noqa: E402

from flashdraft.quant import dequantize  # noqa: E402
from flashdraft.kernels import gguf_triton as tk  # noqa: E402

SHAPES = {"gate/up": (21504, 5376), "down": (5376, 21504), "sliding q": (8192, 5376), "sliding k/v": (4096, 5376)}
SMOKE_SHAPES = {"smoke": (128, 1024)}


@triton.jit
def _scales(sc_w, mn_w, hi_w, d, dmin, J: tl.constexpr):
    """d * sc_J and dmin * m_J (float32 [BLOCK_N]) from the header words of a Q4_K super-block."""
    if J < 4:
        sc = (sc_w >> (8 * J)) & 0x3F
        mn = (mn_w >> (8 * J)) & 0x3F
    else:
        sc = ((hi_w >> (8 * (J - 4))) & 0x0F) | (((sc_w >> (8 * (J - 4) + 6)) & 0x03) << 4)
        mn = ((hi_w >> (8 * (J - 4) + 4)) & 0x0F) | (((mn_w >> (8 * (J - 4) + 6)) & 0x03) << 4)
    return d * sc.to(tl.float32), dmin * mn.to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def q4k_lab_kernel(x_ptr, xq_ptr, xd_ptr, w_ptr, p_ptr, M, N, row_bytes, K: tl.constexpr, MODE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SB_PER_SPLIT: tl.constexpr):
    """MODE 0 load-only, 1 factored (weights second operand), 2 factored (weights first), 3 int8.
    Writes fp32 partials p[pid_k, m, n]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    row = w_ptr + rn.to(tl.int64) * row_bytes
    i32 = tl.arange(0, 32)
    if MODE == 2:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bsum = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for t in range(SB_PER_SPLIT):
        sb = pid_k * SB_PER_SPLIT + t
        base = row + sb * 144
        hdr = base.to(tl.pointer_type(tl.int32))
        w0 = tl.load(hdr)
        sc_w = tl.load(hdr + 1)
        mn_w = tl.load(hdr + 2)
        hi_w = tl.load(hdr + 3)
        d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        for g in tl.static_range(4):
            b = tl.load(base[:, None] + 16 + 32 * g + i32[None, :])          # uint8 [BLOCK_N, 32]
            if MODE == 0:
                bsum += tl.sum(b.to(tl.int32), axis=1) + (w0 ^ sc_w ^ mn_w ^ hi_w)
            else:
                for h in tl.static_range(2):
                    dl, ml = _scales(sc_w, mn_w, hi_w, d, dmin, 2 * g + h)
                    if h == 0:
                        q = b & 0x0F
                    else:
                        q = b >> 4
                    koff = sb * 256 + 32 * (2 * g + h)
                    if MODE == 3:
                        xq = tl.load(xq_ptr + rm[:, None] * K + koff + i32[None, :], mask=m_ok[:, None], other=0)
                        xd = tl.load(xd_ptr + rm * (K // 32) + koff // 32, mask=m_ok, other=0.0)   # [BLOCK_M]
                        xs = tl.sum(xq.to(tl.int32), axis=1).to(tl.float32) * xd
                        part = tl.dot(xq, tl.trans(q.to(tl.int8)))                         # int32 [M, N]
                        acc += (part.to(tl.float32) * xd[:, None]) * dl[None, :] - xs[:, None] * ml[None, :]
                    else:
                        wq = (q.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True).to(x_ptr.dtype.element_ty)  # 128 + q
                        x = tl.load(x_ptr + rm[:, None] * K + koff + i32[None, :], mask=m_ok[:, None], other=0.0)
                        xs = tl.sum(x.to(tl.float32), axis=1)
                        corr = 128.0 * dl + ml
                        if MODE == 1:
                            part = tl.dot(x, tl.trans(wq))                                  # [M, N]
                            acc += part * dl[None, :] - xs[:, None] * corr[None, :]
                        else:
                            part = tl.dot(wq, tl.trans(x))                                  # [N, M]
                            acc += part * dl[:, None] - corr[:, None] * xs[None, :]
    out = p_ptr + pid_k.to(tl.int64) * M * N
    n_ok = rn < N
    if MODE == 0:
        tl.store(out + rn, bsum.to(tl.float32), mask=n_ok)
    elif MODE == 2:
        tl.store(out + rm[None, :] * N + rn[:, None], acc, mask=m_ok[None, :] & n_ok[:, None])
    else:
        tl.store(out + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


_NIBBLES_ASM = tl.constexpr("""
{
.reg .b32 t, u, c;
mov.b32 c, 0x43434343;
and.b32 t, $4, 0x0F0F0F0F;
shr.u32 u, $4, 4;
and.b32 u, u, 0x0F0F0F0F;
prmt.b32 $0, t, c, 0x4140;
prmt.b32 $1, t, c, 0x4342;
prmt.b32 $2, u, c, 0x4140;
prmt.b32 $3, u, c, 0x4342;
}
""")


@triton.jit
def _nibbles_bf16(b, ASM: tl.constexpr, PURE: tl.constexpr = True):
    """uint8 bytes -> (bf16 128 + low nibble, bf16 128 + high nibble), exactly. ASM: 4 bytes per 32-bit register,
    one AND (and one shift) per 4 bytes and one byte permute per 2 weights (prmt places each nibble under the
    exponent byte 0x43 of 128.0); else per-element ops (the interpreter's path)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=PURE, pack=4)
    else:
        lo = ((b & 0x0F).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
        hi = ((b >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _load_sb(w_ptr, rn, row_bytes, N, sb, SB_MAJOR: tl.constexpr):
    """Header words and the four 32-byte quant runs of super-block sb for rows rn."""
    if SB_MAJOR:
        base = w_ptr + (sb * N + rn).to(tl.int64) * 144
    else:
        base = w_ptr + rn.to(tl.int64) * row_bytes + sb * 144
    hdr = base.to(tl.pointer_type(tl.int32))
    i32 = tl.arange(0, 32)
    w0 = tl.load(hdr)
    sc_w = tl.load(hdr + 1)
    mn_w = tl.load(hdr + 2)
    hi_w = tl.load(hdr + 3)
    b0 = tl.load(base[:, None] + 16 + i32[None, :])
    b1 = tl.load(base[:, None] + 48 + i32[None, :])
    b2 = tl.load(base[:, None] + 80 + i32[None, :])
    b3 = tl.load(base[:, None] + 112 + i32[None, :])
    return w0, sc_w, mn_w, hi_w, b0, b1, b2, b3


@triton.jit
def _sb_pair(acc, x_ptr, rm, m_ok, K: tl.constexpr, sb, b, sc_w, mn_w, hi_w, d, dmin, G: tl.constexpr,
             ASM: tl.constexpr, W_AS_A: tl.constexpr):
    i32 = tl.arange(0, 32)
    lo, hi = _nibbles_bf16(b, ASM > 0, ASM < 2)
    for h in tl.static_range(2):
        dl, ml = _scales(sc_w, mn_w, hi_w, d, dmin, 2 * G + h)
        if h == 0:
            wq = lo.to(x_ptr.dtype.element_ty)
        else:
            wq = hi.to(x_ptr.dtype.element_ty)
        koff = sb * 256 + 32 * (2 * G + h)
        x = tl.load(x_ptr + rm[:, None] * K + koff + i32[None, :], mask=m_ok[:, None], other=0.0)
        xs = tl.sum(x.to(tl.float32), axis=1)
        corr = 128.0 * dl + ml
        if W_AS_A:
            part = tl.dot(wq, tl.trans(x))
            acc += part * dl[:, None] - corr[:, None] * xs[None, :]
        else:
            part = tl.dot(x, tl.trans(wq))
            acc += part * dl[None, :] - xs[:, None] * corr[None, :]
    return acc


@triton.jit(do_not_specialize=["M"])
def q4k_lab2_kernel(x_ptr, w_ptr, p_ptr, M, N, row_bytes, K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, SB_PER_SPLIT: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
                    SB_MAJOR: tl.constexpr, W_AS_A: tl.constexpr, LOAD_ONLY: tl.constexpr):
    """Factored Q4_K with the nibble conversion in inline PTX (ASM), the next super-block's bytes loaded before
    the current one is used (PREFETCH), and optionally blocks stored super-block-major (SB_MAJOR: the BLOCK_N
    rows of one super-block are contiguous)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bsum = tl.zeros((BLOCK_N,), dtype=tl.int32)
    sb0 = pid_k * SB_PER_SPLIT
    w0, sc_w, mn_w, hi_w, b0, b1, b2, b3 = _load_sb(w_ptr, rn, row_bytes, N, sb0, SB_MAJOR)
    for t in range(SB_PER_SPLIT):
        sb = sb0 + t
        if PREFETCH:  # this super-block's words were loaded last iteration; load the next one's now
            c0, c_sc, c_mn, c_hi, cb0, cb1, cb2, cb3 = w0, sc_w, mn_w, hi_w, b0, b1, b2, b3
            nxt = tl.minimum(sb + 1, sb0 + SB_PER_SPLIT - 1)
            w0, sc_w, mn_w, hi_w, b0, b1, b2, b3 = _load_sb(w_ptr, rn, row_bytes, N, nxt, SB_MAJOR)
        else:
            c0, c_sc, c_mn, c_hi, cb0, cb1, cb2, cb3 = _load_sb(w_ptr, rn, row_bytes, N, sb, SB_MAJOR)
        if LOAD_ONLY:
            bsum += tl.sum(cb0.to(tl.int32) + cb1 + cb2 + cb3, axis=1) + (c0 ^ c_sc ^ c_mn ^ c_hi)
        else:
            d = (c0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((c0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            acc = _sb_pair(acc, x_ptr, rm, m_ok, K, sb, cb0, c_sc, c_mn, c_hi, d, dmin, 0, ASM, W_AS_A)
            acc = _sb_pair(acc, x_ptr, rm, m_ok, K, sb, cb1, c_sc, c_mn, c_hi, d, dmin, 1, ASM, W_AS_A)
            acc = _sb_pair(acc, x_ptr, rm, m_ok, K, sb, cb2, c_sc, c_mn, c_hi, d, dmin, 2, ASM, W_AS_A)
            acc = _sb_pair(acc, x_ptr, rm, m_ok, K, sb, cb3, c_sc, c_mn, c_hi, d, dmin, 3, ASM, W_AS_A)
    out = p_ptr + pid_k.to(tl.int64) * M * N
    n_ok = rn < N
    if LOAD_ONLY:
        tl.store(out + rn, bsum.to(tl.float32), mask=n_ok)
    elif W_AS_A:
        tl.store(out + rm[None, :] * N + rn[:, None], acc, mask=m_ok[None, :] & n_ok[:, None])
    else:
        tl.store(out + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _u6_f32(v, magic):
    """float32 of a small non-negative integer without I2F (quarter rate): OR its bits under 2**23, subtract."""
    return (v | magic).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _scales_fast(sc_w, mn_w, hi_w, d, dmin, magic, J: tl.constexpr):
    if J < 4:
        sc = (sc_w >> (8 * J)) & 0x3F
        mn = (mn_w >> (8 * J)) & 0x3F
    else:
        sc = ((hi_w >> (8 * (J - 4))) & 0x0F) | (((sc_w >> (8 * (J - 4) + 6)) & 0x03) << 4)
        mn = ((hi_w >> (8 * (J - 4) + 4)) & 0x0F) | (((mn_w >> (8 * (J - 4) + 6)) & 0x03) << 4)
    return d * _u6_f32(sc, magic), dmin * _u6_f32(mn, magic)


@triton.jit(do_not_specialize=["M"])
def q4k_lab3_kernel(x_ptr, xs_ptr, w_ptr, p_ptr, M, N, row_bytes, magic, K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, SB_PER_SPLIT: tl.constexpr, ASM: tl.constexpr, SB_MAJOR: tl.constexpr,
                    XS: tl.constexpr):
    """Factored Q4_K, weights as the dot's first operand, fma epilogue, scales without I2F. XS 1: the sums of x
    per 32 values come precomputed (xs [M, K / 32] float32), 0: summed in the kernel per sub-block."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    i32 = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(SB_PER_SPLIT):
        sb = pid_k * SB_PER_SPLIT + t
        w0, sc_w, mn_w, hi_w, b0, b1, b2, b3 = _load_sb(w_ptr, rn, row_bytes, N, sb, SB_MAJOR)
        d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        for g in tl.static_range(4):
            if g == 0:
                b = b0
            elif g == 1:
                b = b1
            elif g == 2:
                b = b2
            else:
                b = b3
            lo, hi = _nibbles_bf16(b, ASM > 0, ASM < 2)
            for h in tl.static_range(2):
                j = 2 * g + h
                dl, ml = _scales_fast(sc_w, mn_w, hi_w, d, dmin, magic, j)
                if h == 0:
                    wq = lo.to(x_ptr.dtype.element_ty)
                else:
                    wq = hi.to(x_ptr.dtype.element_ty)
                koff = sb * 256 + 32 * j
                x = tl.load(x_ptr + rm[:, None] * K + koff + i32[None, :], mask=m_ok[:, None], other=0.0)
                if XS:
                    xs = tl.load(xs_ptr + rm * (K // 32) + sb * 8 + j, mask=m_ok, other=0.0)
                else:
                    xs = tl.sum(x.to(tl.float32), axis=1)
                part = tl.dot(wq, tl.trans(x))
                acc = tl.fma(part, dl[:, None], acc)
                acc = tl.fma(-(128.0 * dl + ml)[:, None], xs[None, :], acc)
    out = p_ptr + pid_k.to(tl.int64) * M * N
    n_ok = rn < N
    tl.store(out + rm[None, :] * N + rn[:, None], acc, mask=m_ok[None, :] & n_ok[:, None])


MODES = {"load": 0, "fact": 1, "fact_a": 2, "int8": 3}


def quantize_x(x: torch.Tensor):
    """x [M, K] -> int8 [M, K] and float32 scales [M, K // 32] (amax / 127 per 32 values, round to nearest)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1) / 127.0
    q = torch.where(d[..., None] > 0, torch.round(xb / d[..., None].clamp_min(1e-30)), torch.zeros_like(xb))
    return q.to(torch.int8).reshape(x.shape), d.contiguous()


def lab_launch(mode: str, x, xq, xd, blocks, n, block_n, warps, stages, split):
    m, k = x.shape
    nsb = k // 256
    assert nsb % split == 0
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    q4k_lab_kernel[(triton.cdiv(n, block_n), split)](
        x, xq, xd, blocks, part, m, n, blocks.shape[1], K=k, MODE=MODES[mode], BLOCK_M=16, BLOCK_N=block_n,
        SB_PER_SPLIT=nsb // split, num_warps=warps, num_stages=stages)
    return part.sum(0) if split > 1 else part[0]


def lab2_launch(x, blocks_any, n, block_n, warps, stages, split, asm, prefetch, sb_major, w_as_a, load_only=False):
    m, k = x.shape
    nsb = k // 256
    asm = asm and x.device.type == "cuda"   # the interpreter runs no inline PTX
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    q4k_lab2_kernel[(triton.cdiv(n, block_n), split)](
        x, blocks_any, part, m, n, k // 256 * 144, K=k, BLOCK_M=16, BLOCK_N=block_n, SB_PER_SPLIT=nsb // split,
        ASM=asm, PREFETCH=prefetch, SB_MAJOR=sb_major, W_AS_A=w_as_a, LOAD_ONLY=load_only, num_warps=warps,
        num_stages=stages)
    return part.sum(0) if split > 1 else part[0]


# name -> (asm, prefetch, sb_major, w_as_a, load_only), with the tilings (block_n, warps, stages) to time
LAB2 = {
    "asm": ((1, 0, 0, 1, 0), ((64, 4, 2), (128, 8, 2), (128, 4, 2))),
    "asm_b": ((1, 0, 0, 0, 0), ((64, 4, 2), (128, 8, 2))),
    "asm_pf": ((1, 1, 0, 1, 0), ((64, 4, 1), (128, 8, 1), (128, 4, 1), (64, 4, 2))),
    "asm_sbm": ((1, 0, 1, 1, 0), ((64, 4, 2), (128, 8, 2))),
    "asm_pf_sbm": ((1, 1, 1, 1, 0), ((64, 4, 1), (128, 8, 1), (128, 4, 1), (64, 2, 1), (32, 2, 1))),
    "pf_sbm": ((0, 1, 1, 1, 0), ((128, 8, 1), (64, 4, 1))),
    "load_pf": ((0, 1, 0, 1, 1), ((128, 8, 1), (64, 4, 1))),
    "load_pf_sbm": ((0, 1, 1, 1, 1), ((128, 8, 1), (64, 4, 1))),
}


def lab3_launch(x, xs, blocks_any, n, block_n, warps, stages, split, asm, sb_major, use_xs):
    m, k = x.shape
    nsb = k // 256
    asm = asm if x.device.type == "cuda" else 0
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    q4k_lab3_kernel[(triton.cdiv(n, block_n), split)](
        x, xs, blocks_any, part, m, n, k // 256 * 144, 0x4B000000, K=k, BLOCK_M=16, BLOCK_N=block_n,
        SB_PER_SPLIT=nsb // split, ASM=asm, SB_MAJOR=sb_major, XS=use_xs, num_warps=warps, num_stages=stages)
    return part.sum(0) if split > 1 else part[0]


def x_sums(x):
    return x.float().reshape(x.shape[0], -1, 32).sum(-1)


# name -> (asm, sb_major, xs precomputed, xs timed), tilings
LAB3 = {
    "f3": ((2, 0, 0, 0), ((128, 8, 2), (64, 4, 2), (128, 4, 2), (32, 1, 2), (64, 2, 2), (32, 2, 3))),
    "f3_xs": ((2, 0, 1, 0), ((128, 8, 2), (64, 4, 2), (128, 4, 2), (32, 1, 2), (64, 2, 2), (32, 2, 3))),
    "f3_xs_sbm": ((2, 1, 1, 0), ((128, 4, 2), (32, 1, 2), (64, 2, 2))),
    "f3_xs_timed": ((2, 0, 1, 1), ((128, 4, 2), (32, 1, 2))),
}


def candidates(n: int, k: int, only: set | None):
    sms = 132
    out = []
    for mode in ("load", "fact", "fact_a", "int8"):
        for bn, warps, stages in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 4, 4), (128, 8, 2)):
            if mode == "load" and (bn, warps, stages) not in ((64, 4, 3), (128, 8, 3)):
                continue
            if mode == "int8" and (bn, warps, stages) not in ((64, 4, 3), (128, 8, 3)):
                continue
            split = tk.split_for(n, k, bn, 256, sms)
            out.append((mode, bn, warps, stages, split))
    for mode, (_, tilings) in list(LAB2.items()) + list(LAB3.items()):
        for bn, warps, stages in tilings:
            out.append((mode, bn, warps, stages, tk.split_for(n, k, bn, 256, sms)))
    return [c for c in out if only is None or c[0] in only]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter smoke run (set TRITON_INTERPRET=1)")
    ap.add_argument("--only", default=None)
    ap.add_argument("--shapes", default=None, help="comma-separated names of SHAPES")
    ap.add_argument("--ncu", default=None, help="launch one candidate (mode,bn,warps,stages) a few times and exit")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if args.tiny else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    only = set(args.only.split(",")) if args.only else None
    shapes = SMOKE_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    bw = 4300.0
    if not args.tiny and not args.ncu:
        a = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev).normal_()
        b = torch.empty_like(a)
        ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
        bw = 2 * a.numel() * 2 / (ms / 1000) / 1e9
        del a, b
        print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    if args.ncu:
        mode, bn, warps, stages = args.ncu.split(",")
        n, k = SHAPES["gate/up"]
        blocks = random_blocks("Q4_K", n, k, gen, dev)
        x = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=gen)
        xq, xd = quantize_x(x)
        for _ in range(3):
            if mode == "adopted":
                tk.launch(x, blocks, n, "Q4_K")
            elif mode in LAB3:
                asm, sbm_, use_xs, timed = LAB3[mode][0]
                wl = blocks.view(n, k // 256, 144).transpose(0, 1).contiguous() if sbm_ else blocks
                lab3_launch(x, x_sums(x), wl, n, int(bn), int(warps), int(stages),
                            tk.split_for(n, k, int(bn), 256, 132), asm, sbm_, use_xs)
            elif mode in LAB2:
                flags = LAB2[mode][0]
                wl = blocks.view(n, k // 256, 144).transpose(0, 1).contiguous() if flags[2] else blocks
                lab2_launch(x, wl, n, int(bn), int(warps), int(stages), tk.split_for(n, k, int(bn), 256, 132), *flags)
            else:
                lab_launch(mode, x, xq, xd, blocks, n, int(bn), int(warps), int(stages),
                           tk.split_for(n, k, int(bn), 256, 132))
        torch.cuda.synchronize()
        return 0
    rows = []
    t0 = time.time()
    for shape, (n, k) in shapes.items():
        nbytes = n * k // 256 * 144
        copies = copies_for(nbytes, args.tiny)
        ws = [random_blocks("Q4_K", n, k, gen, dev) for _ in range(copies)]
        # the same bytes, super-block-major: [K / 256, N, 144]
        sbm = {id(w): w.view(n, k // 256, 144).transpose(0, 1).contiguous() for w in ws}
        x16 = torch.randn(16, k, device=dev, dtype=torch.bfloat16 if not args.tiny else torch.float32, generator=gen)
        ref = (x16.double() @ dequantize(ws[0], "Q4_K").double().T)
        xq16, xd16 = quantize_x(x16)
        xs16 = x_sums(x16)
        roof_us = nbytes / (bw * 1e3)
        cands = [("adopted", 0, 0, 0, 0)] + candidates(n, k, only) if (only is None or "adopted" in only) \
            else candidates(n, k, only)
        for mode, bn, warps, stages, split in cands:
            def call(w, mm, mode=mode, bn=bn, warps=warps, stages=stages, split=split):
                if mode == "adopted":
                    return tk.launch(x16[:mm], w, n, "Q4_K")
                if mode in LAB3:
                    asm, sbm_, use_xs, timed = LAB3[mode][0]
                    wl = sbm[id(w)] if sbm_ else w
                    xs = x_sums(x16[:mm]) if timed else xs16[:mm]
                    return lab3_launch(x16[:mm], xs, wl, n, bn, warps, stages, split, asm, sbm_, use_xs)
                if mode in LAB2:
                    flags = LAB2[mode][0]
                    wl = sbm[id(w)] if flags[2] else w
                    return lab2_launch(x16[:mm], wl, n, bn, warps, stages, split, *flags)
                return lab_launch(mode, x16[:mm], xq16[:mm], xd16[:mm], w, n, bn, warps, stages, split)
            try:
                y16 = call(ws[0], 16)
                y1 = call(ws[0], 1)
                loads = mode.startswith("load")
                err = rel_err(y16, ref) if not loads else float("nan")
                inv = bool(torch.equal(y16[:1], y1)) if not loads else None
                us = {}
                for mm in (1, 16):
                    us[mm] = 1000 * bench_ms([lambda w=w, mm=mm: call(w, mm) for w in ws], args.tiny)
            except Exception as e:  # noqa: BLE001 - a failing candidate is reported, the others still run
                print(f"{shape} {mode} n{bn} w{warps} s{stages}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            r = {"shape": shape, "n": n, "k": k, "mode": mode, "block_n": bn, "warps": warps, "stages": stages,
                 "split": split, "us_m1": us[1], "us_m16": us[16], "roofline_us": roof_us,
                 "pct_roofline_m1": 100 * roof_us / us[1], "rel_err": err, "invariant": inv}
            rows.append(r)
            print(f"{shape:12s} {mode:8s} n{bn:<3d} w{warps} s{stages} split{split}: {us[1]:7.1f} / {us[16]:7.1f} us"
                  f"  roofline {roof_us:5.1f} ({r['pct_roofline_m1']:4.1f}%)  err {err:.2e}  inv {inv}", flush=True)
        del ws
        torch.cuda.empty_cache() if not args.tiny else None
    (args.out / "q4k_lab.json").write_text(json.dumps({"bandwidth_gb_s": bw, "rows": rows,
                                                       "elapsed_s": time.time() - t0}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
