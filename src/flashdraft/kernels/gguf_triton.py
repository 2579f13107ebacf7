"""Triton matmul kernels that read GGUF blocks directly (imported by flashdraft.quant.gpu_kernels on CUDA; the CPU
tests run them under Triton's interpreter, TRITON_INTERPRET=1 set before this module is first imported).

y[M, N] = x[M, K] @ W^T with W held as uint8 blocks [N, row_bytes] (blocks run along K). Each program owns
BLOCK_N output features of one BLOCK_M = 16 row tile and one fixed K range. Per K step it loads the raw bytes of
a [BLOCK_N, BLOCK_K] weight tile once, decodes it to float32 (the formulas of flashdraft.quant.dequant), casts it
to the activation dtype and multiplies with tl.dot, accumulating in fp32. The weights are decoded per element on
the 2-D tile (`_decode_tile_2d`: each element finds its own quant bits and scales, repeated loads served by L1);
the prefill's dequantized copy (`dequantize`) uses the same formulas (Q4_K / Q5_K and lane-order Q6_K read as the
packed decode reads them: `_dequantize_q45_kernel`, `_dequantize_q6_kernel`). Q6_K weights come as QuantLinear keeps
them, in lane order (Q6_K_LANES, flashdraft.quant.q6k_lanes): the GGUF byte offsets below go through _lane_ql /
_lane_qh.

The K-quants' matmul has its own formulation, QuantConfig.packed (`_quant_matmul_packed_kernel`), which works a
super-block (256 weights) at a time and reads the quant bytes as packed words: per super-block and row, the header once
(Q4_K/Q5_K: 4 int32 words holding d, dmin and the 12 scale bytes; Q6_K: d and 16 int8 scales), then the quants as words
([BLOCK_N, 4, 8] int32 words for Q4_K/Q5_K, uint16 half-words for Q6_K). The weights are not put back in K order: each
dot takes the weights that one bit field (byte p of a word, nibble h) of the loaded words holds, [BLOCK_N, 32] in word
order, against x at the matching K indices, so the decode is shifts and masks on the loaded words, with the sub-block
scales decoded once per super-block ([BLOCK_N, 4, 1]) and broadcast. Those K indices are strided, so `launch` permutes x
once per call (`_packed_perm`, the same permutation within every super-block): the 32 x values of dot d of super-block
sb lie at 256 sb + 32 d + 0..31, and the kernel loads them as contiguous vectors. Eight dots of K = 32 per super-block;
the order (super-blocks low to high, then the fixed field order) never depends on M. Same weights and the same fp32
formulas as the per-element decode, but another summation order, so not bitwise equal to it.

Cost nearly flat in M: a 16-row tile holds a whole DFlash verify block, so the weight bytes are read once for
any M <= 16; rows past M are masked loads (zeros) that cost no memory traffic.

Bitwise batch invariance (a token's output row is the same whether 1 or 16 tokens go through, which keeps
greedy DFlash identical to plain decoding):
- the tiling, the K split and the K order are chosen from (qtype, N, K, SM count) alone (`config_for`), never
  from M, and there is no autotuning;
- M is not specialized by the compiler (do_not_specialize), so one binary serves every M;
- a tensor-core product's output row depends only on its own input row; padding rows are zeros;
- with a K split, fp32 partials go to a workspace and a second kernel adds them in split order; no atomics.

K is a compile-time constant (one binary per K; a model has a handful), and so is every loop trip count: the
interpreter cannot run loops with run-time bounds under numpy >= 2.4, and the compiler gets exact trip counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashdraft.kernels.runtime import gpu_sm_count, interpreted
from flashdraft.kernels.split_reduce_triton import round_to, split_reduce_kernel

QTYPE_CODES = {"Q4_0": 0, "Q5_0": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K_LANES": 5, "Q4_1": 6, "Q5_1": 7}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K_LANES")  # 256-weight super-blocks; the others have 32-weight blocks
# bytes a block (Q6_K_LANES: a super-block, its d at the row's end included)
BLOCK_BYTES = {"Q4_0": 18, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K_LANES": 210, "Q4_1": 20,
               "Q5_1": 24}
BLOCK_M = 16           # rows per tile: tl.dot's minimum, and a whole 16-token verify block
PROGRAMS_PER_SM = 2    # the K split aims at about this many programs per multiprocessor
MAX_SPLIT = 8


@dataclass(frozen=True)
class QuantConfig:
    """One tiling. Chosen per (qtype, N, K) and the SM count, never per M (batch invariance)."""

    block_n: int = 64
    block_k: int = 64      # weights per K step (divides 256 for K-quants; a multiple of 32 for the others)
    split_k: int = 1       # fixed K split (> 1: fp32 partials plus a reduce kernel adding them in order)
    num_warps: int = 4
    num_stages: int = 3    # software pipelining
    packed: bool = False   # K-quants only: packed-word decode per super-block (block_k a multiple of 256)

    @property
    def name(self) -> str:
        return f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}" + (
            "q" if self.packed else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# (qtype, N, K) -> the tiling measured fastest at 16 rows among the correct, batch-invariant ones, for the
# Gemma-4-31B Q4_K_S shapes (scripts/gpu/gguf_run.py on an H200, 2026-11-29; docs/performance.md); other shapes
# get default_config.
CONFIGS: dict[tuple[str, int, int], QuantConfig] = {
    ("Q4_K", 21504, 5376): QuantConfig(128, 256, 3, 8, 3, packed=True),  # gate/up: 75 / 77 us at M = 1 / 16
    ("Q4_K", 5376, 21504): QuantConfig(64, 256, 4, 4, 3, packed=True),   # down: 85 / 86 us
    ("Q4_K", 8192, 5376): QuantConfig(64, 256, 3, 4, 1, packed=True),    # sliding q: 31 / 35 us
    ("Q4_K", 4096, 5376): QuantConfig(64, 256, 7, 4, 1, packed=True),    # sliding k/v: 21 / 23 us
    ("Q4_K", 5376, 8192): QuantConfig(64, 256, 4, 4, 1, packed=True),    # sliding o: 36 / 39 us
    ("Q5_K", 5376, 21504): QuantConfig(64, 256, 4, 4, 3, packed=True),   # down, first layers: 100 / 99 us
    ("Q6_K_LANES", 262144, 5376): QuantConfig(64, 256, 1, 4, 3, packed=True),  # tied LM head: 1133 / 1147 us
    # Gemma-4-26B-A4B's experts, one product a (token, choice) pair (launch_experts; scripts/gpu/expert_pairs_run.py
    # --sweep on an H100, 2026-12-07): 2 warps, 8 / 128 pairs against 4 warps (the default); for down, 64 rows a
    # program, where 32 were 2 us faster at 8 pairs (one token) and 20 us slower at 128 (a verify block)
    ("Q4_K", 1408, 2816): QuantConfig(64, 256, 1, 2, 3, packed=True),  # gate|up: 29.5 / 209.5 us (33.6 / 257.0)
    ("Q8_0", 2816, 704): QuantConfig(64, 64, 1, 2, 3),                 # down: 18.8 / 174.6 us (17.0 / 242.2)
}


def default_config(qtype: str, n: int, k: int, sms: int = 132) -> QuantConfig:
    """K-quants: packed-word decode of 64 x 256 tiles, pipelined 3 deep, the tiling measured flat in M (16 rows
    within 3% of 1 row) and within 1.15x of the fastest on every timed Gemma-4-31B shape (the 64 x 64
    per-element one 2.5-4x slower); the other types: heuristic_config's default."""
    if qtype in K_QUANTS and k % 256 == 0:
        return heuristic_config(qtype, n, k, sms, block_k=256, num_stages=3, packed=True)
    return heuristic_config(qtype, n, k, sms)


def config_for(qtype: str, n: int, k: int, sms: int = 132) -> QuantConfig:
    """The tiling for a [n, k] weight of `qtype`: the measured table, else the default. Never depends on M."""
    return CONFIGS.get((qtype, n, k)) or default_config(qtype, n, k, sms)


def split_for(n: int, k: int, block_n: int, block_k: int, sms: int = 132) -> int:
    """The smallest K split that divides the K steps evenly and gives about PROGRAMS_PER_SM programs per SM (at
    most MAX_SPLIT, and at least 2 K steps per split)."""
    steps = -(-k // block_k)
    tiles = -(-n // block_n)
    split = 1
    for d in _divisors(steps):
        if d > MAX_SPLIT or (d > 1 and steps // d < 2):
            break
        split = d
        if tiles * d >= PROGRAMS_PER_SM * sms:
            break
    return split


def heuristic_config(qtype: str, n: int, k: int, sms: int = 132, block_n: int = 64, num_warps: int = 4,
                     num_stages: int = 3, block_k: int = 64, packed: bool = False) -> QuantConfig:
    """A 64 x 64 weight tile per K step, 4 warps, and split_for's K split (the first version had none: 84
    programs for down_proj's 5376 rows); the other arguments select the alternatives that gguf_run.py times.
    packed=True (K-quants; ignored for the others) takes the packed-word decode, block_k rounded up to a
    multiple of 256 (one super-block per K step by default)."""
    packed = packed and qtype in K_QUANTS
    if packed:
        block_k = max(256, -(-block_k // 256) * 256)
        if k % block_k:
            block_k = 256
    elif k < block_k:
        block_k = max(32, 1 << (k - 1).bit_length())
    return QuantConfig(block_n, block_k, split_for(n, k, block_n, block_k, sms), num_warps, num_stages, packed)


@triton.jit
def _fp16_at(ptr, mask):
    """Little-endian fp16 at ptr (uint8 pointers) -> float32 (0 where masked)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte_at(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _int8_at(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _legacy_weight(row, blk, e, mask, QTYPE: tl.constexpr):
    """Weight e (0..31) of 32-weight block blk of a row, as float32, over the broadcast shape of blk and e.
    Q4_0 d*(q-8); Q5_0 d*(q-16) (4 bytes of 5th bits); Q8_0 d*int8; Q4_1 d*q+m; Q5_1 d*q+m (5th bits)."""
    if QTYPE == 0:
        base = row + blk * 18
        q = (_byte_at(base + 2 + e % 16, mask) >> (4 * (e // 16))) & 0x0F
        w = _fp16_at(base, mask) * (q - 8).to(tl.float32)
    elif QTYPE == 1:
        base = row + blk * 22
        q = (_byte_at(base + 6 + e % 16, mask) >> (4 * (e // 16))) & 0x0F
        q = q | (((_byte_at(base + 2 + e // 8, mask) >> (e % 8)) & 1) << 4)
        w = _fp16_at(base, mask) * (q - 16).to(tl.float32)
    elif QTYPE == 2:
        base = row + blk * 34
        w = _int8_at(base + 2 + e, mask) * _fp16_at(base, mask)
    elif QTYPE == 6:
        base = row + blk * 20
        q = (_byte_at(base + 4 + e % 16, mask) >> (4 * (e // 16))) & 0x0F
        w = _fp16_at(base, mask) * q.to(tl.float32) + _fp16_at(base + 2, mask)
    else:
        base = row + blk * 24
        q = (_byte_at(base + 8 + e % 16, mask) >> (4 * (e // 16))) & 0x0F
        q = q | (((_byte_at(base + 4 + e // 8, mask) >> (e % 8)) & 1) << 4)
        w = _fp16_at(base, mask) * q.to(tl.float32) + _fp16_at(base + 2, mask)
    return w


@triton.jit
def _q45_k_weight(row, sb, j, i, mask, FIVE_BIT: tl.constexpr):
    """Weight i (0..31) of sub-block j (0..7) of super-block sb of a Q4_K/Q5_K row, as float32, over the broadcast
    shape of sb, j and i. Super-block: fp16 d, fp16 dmin, 12 bytes of packed 6-bit scales/mins, [Q5_K: 32 bytes of
    5th bits], 128 nibble bytes (byte 32g+i: weight 64g+i low, 64g+32+i high); weight = (d*sc_j)*q - dmin*m_j."""
    if FIVE_BIT:
        base = row + sb * 176
        qs = base + 48
    else:
        base = row + sb * 144
        qs = base + 16
    q = (_byte_at(qs + 32 * (j // 2) + i, mask) >> (4 * (j % 2))) & 0x0F
    if FIVE_BIT:
        q = q | (((_byte_at(base + 16 + i, mask) >> j) & 1) << 4)
    sc_lo = _byte_at(base + 4 + j % 4, mask)
    mn_lo = _byte_at(base + 8 + j % 4, mask)
    hi = _byte_at(base + 12 + j % 4, mask)
    sc = tl.where(j < 4, sc_lo & 0x3F, (hi & 0x0F) | ((sc_lo >> 6) << 4)).to(tl.float32)
    mn = tl.where(j < 4, mn_lo & 0x3F, (hi >> 4) | ((mn_lo >> 6) << 4)).to(tl.float32)
    return (_fp16_at(base, mask) * sc) * q.to(tl.float32) - _fp16_at(base + 2, mask) * mn


@triton.jit
def _lane_ql(o):
    """Where GGUF's Q6_K ql byte o = 64n + 32h + 16g + 4c + b lies in a lane-order super-block (q6k_lanes)."""
    return 64 * ((o >> 5) & 1) + 16 * ((o >> 2) & 3) + 8 * (o >> 6) + 4 * ((o >> 4) & 1) + (o & 3)


@triton.jit
def _lane_qh(o):
    """Where GGUF's Q6_K qh byte 128 + o (o = 32n + 16g + 4c + b) lies in a lane-order super-block."""
    return 128 + 16 * ((o >> 2) & 3) + 8 * (o >> 5) + 4 * ((o >> 4) & 1) + (o & 3)


@triton.jit
def _decode_tile_2d(row, k0, mask, QTYPE: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights W[rows, k0:k0+BLOCK_K] as float32 [BLOCK_N, BLOCK_K], per element (row: [BLOCK_N, 1] row
    pointers): each element finds its own quant bits and scales (repeated loads are served by L1). Q6_K
    super-block (GGUF's offsets, put in lane order): ql[128] (weight 128h+64t+c: byte 64h+c, nibble t), qh[64]
    (weight 128h+32u+c: byte 32h+c, bits 2u..2u+1), int8 scales[16]; its fp16 d at the row's end; weight =
    (d*s_j)*(q-32)."""
    k = k0 + tl.arange(0, BLOCK_K)[None, :]
    if QTYPE == 3 or QTYPE == 4:
        w = _q45_k_weight(row, k // 256, (k % 256) // 32, k % 32, mask, QTYPE == 4)
    elif QTYPE == 5:
        base = row + (k // 256) * 208
        e = k % 256
        h = e // 128
        r = e % 128
        lo = (_byte_at(base + _lane_ql(h * 64 + r % 64), mask) >> (4 * (r // 64))) & 0x0F
        hi = (_byte_at(base + _lane_qh(h * 32 + r % 32), mask) >> (2 * (r // 32))) & 0x03
        d = _fp16_at(row + (K // 256) * 208 + 2 * (k // 256), mask)
        w = (d * _int8_at(base + 192 + e // 16, mask)) * ((lo | (hi << 4)) - 32).to(tl.float32)
    else:
        w = _legacy_weight(row, k // 32, k % 32, mask, QTYPE)
    return w


@triton.jit
def _dot_acc(acc, x, w, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x @ w^T for a float32 weight tile w: IEEE products for fp32 x, else w cast to x's dtype and a
    tensor-core product. The interpreter (UPCAST) multiplies bf16 tiles as raw integers and truncates casts, so
    it gets the values the GPU multiplies, rounded by hand, in float32."""
    if IEEE:
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    elif UPCAST:
        acc = tl.dot(x.to(tl.float32), tl.trans(round_to(w, x.dtype, True)), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    return acc


@triton.jit
def _store_tile(acc, y_ptr, p_ptr, rm, rn, m_ok, M, N, stride_ym, pid_k, SPLIT_K: tl.constexpr,
                UPCAST: tl.constexpr):
    """The output tile: y directly without a K split, else this split's fp32 partials (p[pid_k]), which
    split_reduce_kernel adds in split order."""
    mask = m_ok & (rn[None, :] < N)
    if SPLIT_K == 1:
        if UPCAST:
            acc = round_to(acc, y_ptr.dtype.element_ty, True)
        tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask)
    else:
        base = p_ptr + pid_k.to(tl.int64) * M * N
        tl.store(base + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=mask)


@triton.jit
def _row_tile(pid_m, M, w_ptr, e_ptr, stride_e, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr):
    """The rows of x this program multiplies (rm, and which of them are rows: m_ok) and its weights: rows
    BLOCK_M pid_m .. of w, or with EXPERTS row pid_m alone (the tile's other rows masked) of the weights of its
    expert e_ptr[pid_m], stride_e bytes apart (launch_experts)."""
    r = tl.arange(0, BLOCK_M)
    if EXPERTS:
        rm = pid_m + r
        m_ok = (r == 0)[:, None] & (rm[:, None] < M)
        w_ptr += tl.load(e_ptr + pid_m).to(tl.int64) * stride_e
    else:
        rm = pid_m * BLOCK_M + r
        m_ok = rm[:, None] < M
    return rm, m_ok, w_ptr


# M is never specialized (Triton would otherwise compile separate variants for M == 1 and M % 16 == 0): one
# binary serves every M, which batch invariance relies on.
@triton.jit(do_not_specialize=["M"])
def _quant_matmul_kernel(x_ptr, w_ptr, y_ptr, p_ptr, M, N, row_bytes, stride_xm, stride_ym,
                         K: tl.constexpr, QTYPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr, STEPS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                         e_ptr=None, stride_e=0, EXPERTS: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm, m_ok, w_ptr = _row_tile(pid_m, M, w_ptr, e_ptr, stride_e, BLOCK_M, EXPERTS)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row = w_ptr + (rn.to(tl.int64) * row_bytes)[:, None]
    n_ok = (rn < N)[:, None]
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(STEPS):  # this split's K steps, low to high K: a fixed order
        k0 = (pid_k * STEPS + t) * BLOCK_K
        if EVEN_K:
            x_mask = m_ok
            if EVEN_N:
                w_mask = n_ok | True
            else:
                w_mask = n_ok
        else:
            # legacy types only: K is a multiple of 32, so whole 32-weight blocks are in or out
            x_mask = m_ok & ((k0 + rk)[None, :] < K)
            w_mask = n_ok & ((k0 + rk)[None, :] < K)
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=x_mask, other=0.0)
        w = _decode_tile_2d(row, k0, w_mask, QTYPE, K, BLOCK_K)
        acc = _dot_acc(acc, x, w, IEEE, UPCAST)
    _store_tile(acc, y_ptr, p_ptr, rm, rn, m_ok, M, N, stride_ym, pid_k, SPLIT_K, UPCAST)


@triton.jit
def _field_to_f32(bits, offset: tl.constexpr, B: tl.constexpr):
    """float32((q - offset) * 2**B) from `bits` = 0x4B000000 | (q * 2**B), 0 <= q * 2**B < 2**23 (an unsigned bit
    field left where it lies in its word, other bits cleared, OR the float bits of 2**23), exactly and without an
    int-to-float conversion (a quarter-rate instruction on NVIDIA GPUs): the float 2**23 + q * 2**B minus
    2**23 + offset * 2**B (both exact, so is the difference). The caller multiplies by a scale times 2**-B (exact: a
    power of two on a normal float32), which gives the same product, rounded the same way, as scale * (q - offset).
    The callers OR in 0x4B000000 as `magic`, a kernel argument rather than a literal: the compiler then keeps it in
    a register and fuses mask and OR into one 3-input logic instruction (with two literals it emits two)."""
    return bits.to(tl.float32, bitcast=True) - (8388608.0 + offset * (1 << B))


@triton.jit
def _row_pointers(w_ptr, rn, row_bytes, CHUNK_ROWS: tl.constexpr):
    """[BLOCK_N, 1, 1] pointers to rows rn's first super-blocks: row n at n * row_bytes in GGUF's order; with
    CHUNK_ROWS, Q4_K super-block-major in chunks of that many rows (quant.q4k_columns), at
    (n // CHUNK_ROWS) * CHUNK_ROWS * row_bytes + (n % CHUNK_ROWS) * 144, the next super-block CHUNK_ROWS * 144 on."""
    n = rn.to(tl.int64)
    if CHUNK_ROWS:
        return w_ptr + ((n // CHUNK_ROWS) * CHUNK_ROWS * row_bytes + (n % CHUNK_ROWS) * 144)[:, None, None]
    return w_ptr + (n * row_bytes)[:, None, None]


@triton.jit
def _q45_k_words(row, sb, w_mask, FIVE_BIT: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """Super-block sb of Q4_K/Q5_K rows (row: [BLOCK_N, 1, 1] pointers to each row's first super-block,
    _row_pointers; with CHUNK_ROWS, Q4_K's next one CHUNK_ROWS * 144 bytes on) as int32 words, as _q45_k_packed
    describes: d and dmin as float32, the three scale words, the nibble words [BLOCK_N, 4 (g), 8 (word)] and the
    same shifted down by 16 (bytes 2, 3), and for Q5_K the fifth bits put where each (byte p, nibble h) finds
    them (qh, and shifted down by 16: qh_hi; zeros for Q4_K)."""
    if FIVE_BIT:
        base = row + sb * 176
        qs = (base + 48).to(tl.pointer_type(tl.int32))
    else:
        base = row + sb * (144 * CHUNK_ROWS if CHUNK_ROWS else 144)
        qs = (base + 16).to(tl.pointer_type(tl.int32))
    hdr = base.to(tl.pointer_type(tl.int32))
    w0 = tl.load(hdr, mask=w_mask, other=0)
    sc_w = tl.load(hdr + 1, mask=w_mask, other=0)   # scale bytes 0-3 (scales 0-3, top bits of 4-7)
    mn_w = tl.load(hdr + 2, mask=w_mask, other=0)   # min bytes 0-3
    hi_w = tl.load(hdr + 3, mask=w_mask, other=0)   # low nibbles: scales 4-7, high nibbles: mins 4-7
    d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((w0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    g = tl.arange(0, 4)[None, :, None]
    wd = tl.arange(0, 8)[None, None, :]
    words = tl.load(qs + 8 * g + wd, mask=w_mask, other=0)                      # [BLOCK_N, 4, 8]
    words_hi = words >> 16                                                      # bytes 2, 3 (top bits: junk)
    if FIVE_BIT:
        qh = tl.load((base + 16).to(tl.pointer_type(tl.int32)) + wd, mask=w_mask, other=0)  # [BLOCK_N, 1, 8]
        qh = qh >> (2 * g)           # [BLOCK_N, 4, 8]: the bit of (byte p, nibble h) at 8p + h
        qh_hi = qh >> 16
    else:
        qh = words & 0
        qh_hi = qh
    return d, dmin, sc_w, mn_w, hi_w, words, words_hi, qh, qh_hi


@triton.jit
def _q45_k_scales(d, dmin, sc_w, mn_w, hi_w, h: tl.constexpr):
    """d sc_j and dmin m_j of sub-blocks j = 2g + h ([BLOCK_N, 4, 1]) from the header's scale words."""
    j = 2 * tl.arange(0, 4)[None, :, None] + h                                  # [1, 4, 1] sub-blocks
    sh = 8 * (j % 4)
    a = (sc_w >> sh) & 0xFF
    b = (mn_w >> sh) & 0xFF
    e = (hi_w >> sh) & 0xFF
    sc = tl.where(j < 4, a & 0x3F, (e & 0x0F) | ((a >> 6) << 4))
    mn = tl.where(j < 4, b & 0x3F, (e >> 4) | ((b >> 6) << 4))
    return d * sc.to(tl.float32), dmin * mn.to(tl.float32)


@triton.jit
def _q45_k_field(words, words_hi, t_lo, t_hi, dl, ml, magic, h: tl.constexpr, p: tl.constexpr,
                 FIVE_BIT: tl.constexpr):
    """The weights of (nibble h, byte p) of the nibble words, [BLOCK_N, 4 (g), 8 (word)] float32: weight
    64g + 32h + 4w + p of the super-block. Q5_K: t_lo / t_hi, qh / qh_hi shifted up by 3h + 4."""
    B = 8 * (p % 2) + 4 * h
    if p < 2:
        src = words
    else:
        src = words_hi
    if FIVE_BIT:  # 5th bits moved to bit B + 4 (B = 8 (p % 2) + 4h)
        if p < 2:
            bits = (src & (0x0F << B)) | ((t_lo & (0x10 << B)) | magic)
        else:
            bits = (src & (0x0F << B)) | ((t_hi & (0x10 << B)) | magic)
    else:
        bits = (src & (0x0F << B)) | magic
    return (dl * (1.0 / (1 << B))) * _field_to_f32(bits, 0, B) - ml


@triton.jit
def _q45_k_packed(acc, x_rows, x_mask, row, sb, w_mask, magic, FIVE_BIT: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr, UPCAST: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """acc += x[:, super-block sb] @ W[:, super-block sb]^T for Q4_K/Q5_K; row: [BLOCK_N, 1, 1] uint8 row pointers.

    Super-blocks are 144/176 bytes, so with 16-byte aligned rows (row_bytes is a multiple of 144/176, a multiple of
    16) every field is 16-byte aligned and read as int32 words: the header (d | dmin << 16, then the scale bytes
    4-7, 8-11, 12-15) and the 128 nibble bytes as [BLOCK_N, 4 (g), 8 (word)] words. Byte p of word 8g + w is byte
    32g + 4w + p, whose low nibble is weight 64g + 4w + p (sub-block 2g) and high nibble weight 64g + 32 + 4w + p
    (sub-block 2g + 1). Q5_K: 32 bytes of 5th bits (8 words, the same for every g): byte 4w + p, bit j -> weight
    32j + 4w + p. One dot per (nibble h, byte p), dot d = 4h + p: a [BLOCK_N, 32] tile in word order (column
    8g + w) against x at K = 256 sb + 64g + 32h + 4w + p, which the permuted x (`_packed_perm`) holds at
    256 sb + 32d + 8g + w, so x_rows points into the permuted x. Bytes 2 and 3 are taken from the words shifted
    down by 16, so every nibble is masked where it lies (bit B = 8 (p % 2) + 4h, <= 12) and converted by
    _field_to_f32, its scale times 2**-B."""
    d, dmin, sc_w, mn_w, hi_w, words, words_hi, qh, qh_hi = _q45_k_words(row, sb, w_mask, FIVE_BIT, CHUNK_ROWS)
    c = tl.arange(0, 32)
    for h in tl.static_range(2):
        dl, ml = _q45_k_scales(d, dmin, sc_w, mn_w, hi_w, h)
        t_lo = qh << (3 * h + 4)
        t_hi = qh_hi << (3 * h + 4)
        for p in tl.static_range(4):
            w = _q45_k_field(words, words_hi, t_lo, t_hi, dl, ml, magic, h, p, FIVE_BIT)
            x = tl.load(x_rows + (sb * 256 + 32 * (4 * h + p) + c)[None, :], mask=x_mask, other=0.0)  # dot 4h + p
            acc = _dot_acc(acc, x, tl.reshape(w, (BLOCK_N, 32)), IEEE, UPCAST)
    return acc


@triton.jit
def _q6_k_packed(acc, x_rows, x_mask, row, sb, w_mask, magic, NSB: tl.constexpr, BLOCK_N: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc += x[:, super-block sb] @ W[:, super-block sb]^T for lane-order Q6_K rows of NSB super-blocks; row:
    [BLOCK_N, 1, 1] uint8 row pointers.

    The quants are read as uint16 half-words, on a [BLOCK_N, 4 (s), 8 (half-word)] grid with s = 2hh + b (hh: the
    128-weight half, b: which 16 bytes of a 32): GGUF's ql half-words 32hh + 16(u % 2) + 8b + w, qh half-words 64 + 8s +
    w, found in lane order by _lane_ql / _lane_qh (a half-word's two bytes stay side by side). Byte r of those holds
    weight e = 128hh + 32u + 16b + 2w + r: low nibbles (u < 2) or high nibbles of ql, bits 2u, 2u + 1 of qh; its scale
    is int8 byte 192 + e // 16 = 192 + 8hh + 2u + b ([BLOCK_N, 4, 1] per u). One dot per (u, r), dot d = 2u + r: a
    [BLOCK_N, 32] tile, column 8s + w, against x at K = 256 sb + 128hh + 32u + 16b + 2w + r, which the permuted x
    (`_packed_perm`) holds at 256 sb + 32d + 8s + w, so x_rows points into the permuted x. The 6-bit value is assembled
    where its low nibble lies (bit B = 8r + 4 (u // 2)), the qh bits shifted up to B + 4 (by 4 or 2), and converted by
    _field_to_f32, its scale times 2**-B."""
    base, d, ql0, ql1, qh4, qh2 = _q6_k_words(row, sb, w_mask, NSB)
    c = tl.arange(0, 32)
    for u in tl.static_range(4):
        dl = _q6_k_scale(base, d, w_mask, u)
        for r in tl.static_range(2):
            w = _q6_k_field(ql0, ql1, qh4, qh2, dl, magic, u, r)
            x = tl.load(x_rows + (sb * 256 + 32 * (2 * u + r) + c)[None, :], mask=x_mask, other=0.0)  # dot 2u + r
            acc = _dot_acc(acc, x, tl.reshape(w, (BLOCK_N, 32)), IEEE, UPCAST)
    return acc


@triton.jit
def _q6_k_words(row, sb, w_mask, NSB: tl.constexpr):
    """Super-block sb of lane-order Q6_K rows of NSB super-blocks, as _q6_k_packed reads it: the super-block's
    address, d as float32, the ql half-words of runs 0/2 and 1/3, and the qh half-words shifted up by 4 and by 2,
    each [BLOCK_N, 4 (s), 8 (half-word)] int32."""
    base = row + sb * 208
    hw = base.to(tl.pointer_type(tl.uint16))
    s = tl.arange(0, 4)[None, :, None]
    wd = tl.arange(0, 8)[None, None, :]
    d_at = (row + NSB * 208).to(tl.pointer_type(tl.uint16)) + sb
    d = tl.load(d_at, mask=w_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)   # [BLOCK_N, 1, 1]
    ql_off = 2 * (32 * (s // 2) + 8 * (s % 2) + wd)                               # GGUF byte offsets
    ql0 = tl.load(hw + _lane_ql(ql_off) // 2, mask=w_mask, other=0).to(tl.int32)       # ql bytes 64hh + 0..31
    ql1 = tl.load(hw + _lane_ql(ql_off + 32) // 2, mask=w_mask, other=0).to(tl.int32)  # ql bytes 64hh + 32..63
    qh = tl.load(hw + _lane_qh(2 * (8 * s + wd)) // 2, mask=w_mask, other=0).to(tl.int32)
    return base, d, ql0, ql1, qh << 4, qh << 2  # qh: bits 2u, 2u + 1 of byte r moved to B + 4, B + 5 (u even, odd)


@triton.jit
def _q6_k_scale(base, d, w_mask, u: tl.constexpr):
    """d sc of the groups of run u, [BLOCK_N, 4 (s), 1]: int8 scale byte 192 + 8hh + 2u + b (s = 2hh + b)."""
    s = tl.arange(0, 4)[None, :, None]
    sc = tl.load(base + 192 + 8 * (s // 2) + 2 * u + s % 2, mask=w_mask, other=0)
    return d * sc.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _q6_k_field(ql0, ql1, qh4, qh2, dl, magic, u: tl.constexpr, r: tl.constexpr):
    """The weights of (run u, byte r) of the half-words, [BLOCK_N, 4 (s), 8 (w)] float32: weight
    128hh + 32u + 16b + 2w + r of the super-block."""
    if u % 2 == 0:
        ql = ql0
        qhs = qh4
    else:
        ql = ql1
        qhs = qh2
    B = 8 * r + 4 * (u // 2)
    bits = (ql & (0x0F << B)) | ((qhs & (0x30 << B)) | magic)
    return (dl * (1.0 / (1 << B))) * _field_to_f32(bits, 32, B)


@triton.jit(do_not_specialize=["M"])
def _quant_matmul_packed_kernel(x_ptr, w_ptr, y_ptr, p_ptr, M, N, row_bytes, stride_xm, stride_ym, magic,
                                K: tl.constexpr, QTYPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                SPLIT_K: tl.constexpr, STEPS: tl.constexpr, EVEN_N: tl.constexpr,
                                EVEN_K: tl.constexpr, e_ptr=None, stride_e=0, EXPERTS: tl.constexpr = False,
                                CHUNK_ROWS: tl.constexpr = 0):
    """_quant_matmul_kernel for the K-quants with the packed-word decode: K steps of BLOCK_K // 256 super-blocks,
    each added by _q45_k_packed / _q6_k_packed; the same grid, split and output as _quant_matmul_kernel. x_ptr is
    the permuted x (`_packed_perm`), not x. CHUNK_ROWS: Q4_K blocks super-block-major in chunks of that many rows
    (_row_pointers), read where they lie."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm, m_ok, w_ptr = _row_tile(pid_m, M, w_ptr, e_ptr, stride_e, BLOCK_M, EXPERTS)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row = _row_pointers(w_ptr, rn, row_bytes, CHUNK_ROWS)
    n_ok = (rn < N)[:, None, None]
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(STEPS):  # this split's K steps, low to high K: a fixed order
        for i in tl.static_range(BLOCK_K // 256):
            sb = (pid_k * STEPS + t) * (BLOCK_K // 256) + i
            if EVEN_N:
                w_mask = n_ok | True
            else:
                w_mask = n_ok
            x_mask = m_ok
            if not EVEN_K:  # super-blocks past K (the last step only): no loads, zero weights
                w_mask = w_mask & (sb < K // 256)
                x_mask = x_mask & (sb < K // 256)
            if QTYPE == 5:
                acc = _q6_k_packed(acc, x_rows, x_mask, row, sb, w_mask, magic, K // 256, BLOCK_N, IEEE, UPCAST)
            else:
                acc = _q45_k_packed(acc, x_rows, x_mask, row, sb, w_mask, magic, QTYPE == 4, BLOCK_N, IEEE, UPCAST,
                                    CHUNK_ROWS)
    _store_tile(acc, y_ptr, p_ptr, rm, rn, m_ok, M, N, stride_ym, pid_k, SPLIT_K, UPCAST)


@triton.jit
def _dequantize_kernel(w_ptr, out_ptr, N, row_bytes, K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """out[rows, k0:k0 + BLOCK_K] = the weights of those rows (_decode_tile_2d's fp32 formulas), cast to out's dtype."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rn < N)[:, None] & (k < K)[None, :]  # K a multiple of 32: whole blocks are in or out
    w = _decode_tile_2d(w_ptr + (rn.to(tl.int64) * row_bytes)[:, None], tl.program_id(1) * BLOCK_K, ok, QTYPE, K,
                        BLOCK_K)
    if UPCAST:  # the interpreter's own casts truncate
        w = round_to(w, out_ptr.dtype.element_ty, True)
    tl.store(out_ptr + rn.to(tl.int64)[:, None] * K + k[None, :], w, mask=ok)


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of a row of k weights (k a whole number of blocks): lane-order Q6_K rows are padded to 16 bytes
    (quant.q6k_lanes, which this package sits below; a test holds the two equal)."""
    nbytes = k // (256 if qtype in K_QUANTS else 32) * BLOCK_BYTES[qtype]
    return -(-nbytes // 16) * 16 if qtype == "Q6_K_LANES" else nbytes


@triton.jit
def _dequantize_q45_kernel(w_ptr, out_ptr, N, row_bytes, magic, FIVE_BIT: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                           BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """out[rows, super-block] = the Q4_K/Q5_K weights of BLOCK_N rows and one super-block (program axis 1), read as
    the packed kernel reads them (words: no byte loads) and written in K order: the four bytes p of each word
    (nibble h) are joined into [BLOCK_N, 4 (g), 32] runs at K = 64g + 32h + 0..31. The same fp32 formulas as
    _decode_tile_2d, cast to out's dtype. CHUNK_ROWS 0: GGUF's rows; else Q4_K blocks super-block-major in chunks
    of that many rows (_row_pointers)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sb = tl.program_id(1)
    n_ok = (rn < N)[:, None, None]
    row = _row_pointers(w_ptr, rn, row_bytes, CHUNK_ROWS)
    d, dmin, sc_w, mn_w, hi_w, words, words_hi, qh, qh_hi = _q45_k_words(row, sb, n_ok, FIVE_BIT, CHUNK_ROWS)
    col = 64 * tl.arange(0, 4)[None, :, None] + tl.arange(0, 32)[None, None, :]    # [1, 4, 32]
    out_rows = out_ptr + (rn.to(tl.int64) * (row_bytes // (176 if FIVE_BIT else 144) * 256))[:, None, None]
    for h in tl.static_range(2):
        dl, ml = _q45_k_scales(d, dmin, sc_w, mn_w, hi_w, h)
        t_lo = qh << (3 * h + 4)
        t_hi = qh_hi << (3 * h + 4)
        w0 = _q45_k_field(words, words_hi, t_lo, t_hi, dl, ml, magic, h, 0, FIVE_BIT)
        w1 = _q45_k_field(words, words_hi, t_lo, t_hi, dl, ml, magic, h, 1, FIVE_BIT)
        w2 = _q45_k_field(words, words_hi, t_lo, t_hi, dl, ml, magic, h, 2, FIVE_BIT)
        w3 = _q45_k_field(words, words_hi, t_lo, t_hi, dl, ml, magic, h, 3, FIVE_BIT)
        # join stacks along a new last axis: [.., w, p // 2, p % 2] is join(join(w0, w2), join(w1, w3)), K 4w + p
        w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_N, 4, 32))
        if UPCAST:  # the interpreter's own casts truncate
            w = round_to(w, out_ptr.dtype.element_ty, True)
        tl.store(out_rows + sb * 256 + 32 * h + col, w, mask=n_ok)


@triton.jit
def _dequantize_q6_kernel(w_ptr, out_ptr, N, row_bytes, magic, NSB: tl.constexpr, BLOCK_N: tl.constexpr,
                          UPCAST: tl.constexpr):
    """_dequantize_q45_kernel for lane-order Q6_K rows: the half-words of the packed decode, the two bytes r of
    each joined into [BLOCK_N, 4 (s), 16] runs at K = 128hh + 32u + 16b + 0..15 (s = 2hh + b)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sb = tl.program_id(1)
    n_ok = (rn < N)[:, None, None]
    row = w_ptr + (rn.to(tl.int64) * row_bytes)[:, None, None]
    base, d, ql0, ql1, qh4, qh2 = _q6_k_words(row, sb, n_ok, NSB)
    s = tl.arange(0, 4)[None, :, None]
    col = 128 * (s // 2) + 16 * (s % 2) + tl.arange(0, 16)[None, None, :]            # [1, 4, 16]
    out_rows = out_ptr + (rn.to(tl.int64) * (NSB * 256))[:, None, None]
    for u in tl.static_range(4):
        dl = _q6_k_scale(base, d, n_ok, u)
        w0 = _q6_k_field(ql0, ql1, qh4, qh2, dl, magic, u, 0)
        w1 = _q6_k_field(ql0, ql1, qh4, qh2, dl, magic, u, 1)
        w = tl.reshape(tl.join(w0, w1), (BLOCK_N, 4, 16))  # [.., w, r]: K 2w + r
        if UPCAST:  # the interpreter's own casts truncate
            w = round_to(w, out_ptr.dtype.element_ty, True)
        tl.store(out_rows + sb * 256 + 32 * u + col, w, mask=n_ok)


def _interpreting() -> bool:
    return interpreted(_quant_matmul_kernel)


def sm_count(device_index: int | None) -> int:
    """Multiprocessors of that GPU (tilings depend on it, never on M); 132 without one."""
    if device_index is None or not torch.cuda.is_available():
        return 132  # an H100/H200: the interpreter tiles as the GPU does
    return gpu_sm_count(device_index)


_PACKED_PERMS: dict[tuple[str, int, torch.device], torch.Tensor] = {}


def _packed_perm(qtype: str, k: int, device: torch.device) -> torch.Tensor:
    """int64 [k]: x[:, perm] is x in the order the packed kernel consumes it. Within every super-block, position
    32 d + c (dot d, column c) takes K index 64g + 32h + 4w + p (Q4_K/Q5_K: d = 4h + p, c = 8g + w) or
    128hh + 32u + 16b + 2w + r (Q6_K: d = 2u + r, c = 8s + w, s = 2hh + b), as _q45_k_packed / _q6_k_packed
    describe. Built with arange ops on the device (no host-to-device copy) and cached per (qtype, k, device);
    one built during CUDA-graph capture is not cached (its values exist only in that graph's replays)."""
    key = (qtype, k, device)
    perm = _PACKED_PERMS.get(key)
    if perm is not None:
        return perm
    c = torch.arange(32, device=device)
    dot = torch.arange(8, device=device)
    if qtype == "Q6_K_LANES":
        col = 128 * (c // 16) + 16 * ((c // 8) % 2) + 2 * (c % 8)
        off = 32 * (dot // 2) + dot % 2
    else:
        col = 64 * (c // 8) + 4 * (c % 8)
        off = 32 * (dot // 4) + dot % 4
    sb = torch.arange(k // 256, device=device)
    perm = (256 * sb[:, None] + (off[:, None] + col[None, :]).reshape(1, 256)).reshape(k)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _PACKED_PERMS[key] = perm
    return perm


def launch(x: torch.Tensor, blocks: torch.Tensor, out_features: int, qtype: str,
           config: QuantConfig | None = None, chunk_rows: int = 0) -> torch.Tensor:
    """y = x @ W^T for W [out_features, K] held as `qtype` blocks (uint8 [out_features, row_bytes]); y in x's
    dtype (bf16/fp16: tensor-core products of the weights rounded to that dtype; fp32: IEEE products).
    No host sync and no allocation besides the output (and the split-K workspace, and for the packed decode the
    permuted x): safe in CUDA graphs. chunk_rows > 0: Q4_K blocks super-block-major in chunks of that many rows
    (quant.q4k_columns), read where they lie by the packed decode."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[0] != out_features:
        raise ValueError(f"{qtype} blocks must be uint8 [{out_features}, row_bytes], got {blocks.dtype} "
                         f"{list(blocks.shape)}")
    _check_chunks(qtype, out_features, chunk_rows)
    lead, k = x.shape[:-1], x.shape[-1]
    return _run(x.reshape(-1, k), blocks, out_features, qtype, config, chunk_rows=chunk_rows).reshape(*lead,
                                                                                                       out_features)


def _check_chunks(qtype: str, n: int, chunk_rows: int) -> None:
    if chunk_rows and (qtype != "Q4_K" or chunk_rows < 0 or n % chunk_rows):
        raise ValueError(f"blocks in chunks of {chunk_rows} rows must be Q4_K with a whole number of chunks, "
                         f"got {qtype} of {n} rows")


MAX_EXPERT_ROWS = 65535  # the grid's third axis, a program a row


def launch_experts(x: torch.Tensor, blocks: torch.Tensor, experts: torch.Tensor, qtype: str,
                   config: QuantConfig | None = None) -> torch.Tensor:
    """y[p] = x[p] @ W[experts[p]]^T for stacked weights W [E, N, K] held as `qtype` blocks (uint8 [E, N,
    row_bytes]): x [P, K], experts int [P] on x's device, y [P, N] in x's dtype. Each row is its own product,
    with the tiling and K split of an [N, K] product (config_for), so a row's bits are those of launch(x[p:p+1],
    W[experts[p]]) whatever P is and whichever rows come with it (batch invariance); only the chosen experts'
    blocks are read, one expert's once per row that chose it. No host sync: safe in CUDA graphs, and so the ids
    are not checked against E (an id out of range reads past the blocks)."""
    if qtype not in QTYPE_CODES:
        raise ValueError(f"no kernel reads {qtype} blocks; these types: {', '.join(QTYPE_CODES)}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[0] == 0:
        raise ValueError(f"{qtype} expert blocks must be uint8 [experts, N, row_bytes], got {blocks.dtype} "
                         f"{list(blocks.shape)}")
    if x.dim() != 2 or experts.shape != (x.shape[0],) or experts.dtype not in (torch.int32, torch.int64) \
            or experts.device != x.device or blocks.device != x.device:
        raise ValueError(f"x must be [P, K] with one int expert id a row, all on one device: got x {list(x.shape)} "
                         f"on {x.device}, experts {experts.dtype} {list(experts.shape)} on {experts.device}, blocks "
                         f"on {blocks.device}")
    if x.shape[0] > MAX_EXPERT_ROWS:
        raise ValueError(f"{x.shape[0]} rows: launch_experts takes at most {MAX_EXPERT_ROWS} (a program a row)")
    if not blocks.is_contiguous():
        blocks = blocks.contiguous()
    return _run(x, blocks, blocks.shape[1], qtype, config, experts.contiguous())


def _run(x2: torch.Tensor, blocks: torch.Tensor, n: int, qtype: str, config: QuantConfig | None,
         experts: torch.Tensor | None = None, chunk_rows: int = 0) -> torch.Tensor:
    """x2 [M, K] times the blocks of one [n, K] weight (blocks 2-D; chunk_rows as launch's), or of row m's expert
    (3-D, experts [M])."""
    code = QTYPE_CODES[qtype]
    k = x2.shape[-1]
    elems = 256 if qtype in K_QUANTS else 32
    if k % elems or blocks.shape[-1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype}: x has {k} features, which does not match blocks of {blocks.shape[-1]} bytes a row")
    if experts is None and (blocks.stride(1) != 1 or blocks.stride(0) != blocks.shape[1]):
        blocks = blocks.contiguous()
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    if config is None:
        sms = sm_count(x2.device.index if x2.device.type == "cuda" else None)
        config = config_for(qtype, n, k, sms)
        if chunk_rows and not config.packed:  # a per-element tiling adopted for the type: chunks need the packed one
            config = default_config(qtype, n, k, sms)
    bk, split = config.block_k, config.split_k
    steps = -(-k // bk)
    if steps % split:
        raise ValueError(f"split {split} does not divide the {steps} K steps of {k} weights")
    if chunk_rows and not config.packed:
        raise ValueError(f"Q4_K blocks in chunks of rows are read by the packed decode only, not {config.name}")
    if config.packed:
        if qtype not in K_QUANTS or bk % 256:
            raise ValueError(f"packed decode is for K-quants with block_k a multiple of 256, not {qtype} / {bk}")
        if blocks.data_ptr() % (2 if qtype == "Q6_K_LANES" else 4):  # words are read whole: an aligned copy
            blocks = blocks.clone()
        # x in the kernel's order: each dot's 32 values contiguous (one gather here instead of strided loads in
        # every program); per row, so independent of M; contiguous, row stride k
        x2 = x2.index_select(1, _packed_perm(qtype, k, x2.device))
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else y
    grid = (triton.cdiv(n, config.block_n), split, m if experts is not None else triton.cdiv(m, BLOCK_M))
    common = dict(K=k, QTYPE=code, IEEE=x2.dtype == torch.float32, UPCAST=_interpreting(), BLOCK_M=BLOCK_M,
                  BLOCK_N=config.block_n, BLOCK_K=bk, SPLIT_K=split, STEPS=steps // split,
                  EVEN_N=n % config.block_n == 0, EVEN_K=k % bk == 0, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    if experts is not None:  # one row a program, over its expert's blocks
        common.update(e_ptr=experts, stride_e=blocks.stride(0), EXPERTS=True)
    if chunk_rows:
        common.update(CHUNK_ROWS=chunk_rows)
    if config.packed:
        _quant_matmul_packed_kernel[grid](x2, blocks, y, part, m, n, blocks.shape[-1], x2.stride(0), y.stride(0),
                                          0x4B000000, **common)
    else:
        _quant_matmul_kernel[grid](x2, blocks, y, part, m, n, blocks.shape[-1], x2.stride(0), y.stride(0), **common)
    if split > 1:
        block = 1024
        split_reduce_kernel[(triton.cdiv(n, block), m)](part, y, y, m, n, y.stride(0), HAS_BIAS=False,
                                                        UPCAST=_interpreting(), SPLIT_K=split, BLOCK=block, num_warps=4)
    return y


DEQUANT_MIN_ROWS = 128       # from this many rows of x (prefill passes), dequantize_matmul instead of launch
DEQUANT_MAX_BYTES = 1 << 29  # ... for weights whose dequantized copy takes at most this much memory (512 MiB)


def dequantizes(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a product of m rows takes dequantize_matmul: launch's tiles of BLOCK_M rows decode every weight
    again for each tile (a 512-token prefill decodes the model 32 times), while a dequantized copy is decoded once
    and multiplied by cuBLAS; the copy's memory bounds it (not for a large vocabulary's LM head)."""
    return m >= DEQUANT_MIN_ROWS and n * k * torch.finfo(dtype).bits // 8 <= DEQUANT_MAX_BYTES


def dequantize(blocks: torch.Tensor, qtype: str, k: int, dtype: torch.dtype, chunk_rows: int = 0) -> torch.Tensor:
    """The weights [N, k] of `qtype` blocks (uint8 [N, row_bytes]) in dtype: the fp32 values of
    flashdraft.quant.dequant, rounded once to dtype (as QuantLinear.weight). One kernel, no host sync.
    chunk_rows as launch's: the blocks read where they lie."""
    n = blocks.shape[0]
    elems = 256 if qtype in K_QUANTS else 32
    nbytes = row_bytes(qtype, k)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or k % elems or blocks.shape[1] != nbytes:
        raise ValueError(f"{qtype} blocks of {k} weights a row must be uint8 [N, {nbytes}], "
                         f"got {blocks.dtype} {list(blocks.shape)}")
    _check_chunks(qtype, n, chunk_rows)
    if blocks.stride(1) != 1 or blocks.stride(0) != blocks.shape[1]:
        blocks = blocks.contiguous()
    out = torch.empty((n, k), dtype=dtype, device=blocks.device)
    block_n, block_k = 32, 256
    if qtype in ("Q4_K", "Q5_K"):  # the words of the packed decode, written in K order
        if blocks.data_ptr() % 4:
            blocks = blocks.clone()
        _dequantize_q45_kernel[(triton.cdiv(n, block_n), k // 256)](
            blocks, out, n, blocks.shape[1], 0x4B000000, FIVE_BIT=qtype == "Q5_K", CHUNK_ROWS=chunk_rows,
            BLOCK_N=block_n, UPCAST=_interpreting(), num_warps=4)
        return out
    if qtype == "Q6_K_LANES":  # the half-words of the packed decode, written in K order
        if blocks.data_ptr() % 2:
            blocks = blocks.clone()
        _dequantize_q6_kernel[(triton.cdiv(n, block_n), k // 256)](
            blocks, out, n, blocks.shape[1], 0x4B000000, NSB=k // 256, BLOCK_N=block_n, UPCAST=_interpreting(),
            num_warps=4)
        return out
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        blocks, out, n, blocks.shape[1], K=k, QTYPE=QTYPE_CODES[qtype], BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=_interpreting(), num_warps=4)
    return out


def dequantize_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str, chunk_rows: int = 0) -> torch.Tensor:
    """y = x @ W^T through a dequantized copy of W in x's dtype (freed on return) and F.linear: for passes of
    many rows (dequantizes); chunk_rows as dequantize's."""
    return torch.nn.functional.linear(x, dequantize(blocks, qtype, x.shape[-1], x.dtype, chunk_rows))
