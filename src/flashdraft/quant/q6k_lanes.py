"""Q6_K weights in lane order (Q6_K_LANES): the bytes of GGUF's Q6_K blocks, re-laid out once at load time so that
the GPU kernels read them with 16-byte loads.

GGUF's Q6_K super-block is 210 bytes (ql[128], qh[64], int8 scales[16], fp16 d), so blocks are only 2-byte
aligned and the tensor-core kernel read them as 16-bit words: 71 loads and 148 byte permutes a super-block where
Q4_K's 144-byte blocks take 18 wide loads (docs/performance.md, "Next for #18: the Q6_K product's loads"). Here a
row of nsb super-blocks is

    [nsb x 208 bytes: each super-block's ql and qh in lane order, then its 16 scales][nsb x fp16 d][zeros]

padded to a multiple of 16 bytes (no padding when nsb is a multiple of 8: 4096 or 12288 wide rows keep their 210
nsb bytes). Lane order puts the bytes that lane c of the kernel's MMA fragments reads next to each other: ql byte
64n + 32h + 16g + 4c + b (n: the 128-weight half, h: low or high 32-byte run, g: which 16 of a run, b: byte of a
word) moves to 64h + 16c + 8n + 4g + b, qh byte 128 + 32n + 16g + 4c + b to 128 + 16c + 8n + 4g + b; in each 64
bytes lane c's 16 are one aligned load, and the 4 lanes of a weight row read 64 contiguous bytes. The scales stay
at 192-207 of the super-block. Every byte keeps its value: the weights are gguf-py's bit for bit (tests).

A row holds all of its own bytes (d included), so rows can be gathered (an embedding lookup), concatenated (fused
projections) and dequantized one by one, as GGUF rows can.
"""
from __future__ import annotations

import torch

QTYPE = "Q6_K_LANES"
GGUF_QTYPE = "Q6_K"
SUPER_BLOCK = 256     # weights
GGUF_BYTES = 210      # bytes of a GGUF super-block
QUANT_BYTES = 208     # of a lane-order super-block (ql, qh, scales): 13 aligned 16-byte chunks


def kept_qtype(qtype: str) -> str:
    """The type under which QuantLinear / QuantEmbedding keep blocks of this type: Q6_K_LANES for Q6_K."""
    return QTYPE if qtype == GGUF_QTYPE else qtype


def row_bytes(k: int) -> int:
    """Bytes of a lane-order row of k weights: 210 a super-block, rounded up to 16."""
    if k % SUPER_BLOCK:
        raise ValueError(f"{QTYPE}: row length {k} is not a multiple of the block size {SUPER_BLOCK}")
    return -(-k // SUPER_BLOCK * GGUF_BYTES // 16) * 16


def super_blocks(row_bytes_: int) -> int:
    """The super-blocks of a lane-order row of that many bytes (its padding is under 16 bytes)."""
    nsb = row_bytes_ // GGUF_BYTES
    if row_bytes(nsb * SUPER_BLOCK) != row_bytes_:
        raise ValueError(f"{QTYPE}: {row_bytes_} bytes is not the row size of any row length")
    return nsb


def from_gguf(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q6_K rows uint8 [..., nsb * 210] -> lane-order rows uint8 [..., row_bytes]; on blocks' device."""
    lead, nbytes = blocks.shape[:-1], blocks.shape[-1]
    if blocks.dtype != torch.uint8 or nbytes % GGUF_BYTES:
        raise ValueError(f"{GGUF_QTYPE} rows must be uint8 [..., a multiple of {GGUF_BYTES}], got {blocks.dtype} "
                         f"{list(blocks.shape)}")
    nsb = nbytes // GGUF_BYTES
    b = blocks.reshape(-1, nsb, GGUF_BYTES)
    rows = b.shape[0]
    ql = b[..., :128].reshape(rows, nsb, 2, 2, 2, 4, 4).permute(0, 1, 3, 5, 2, 4, 6)  # (n, h, g, c, b): (h, c, n, g, b)
    qh = b[..., 128:192].reshape(rows, nsb, 2, 2, 4, 4).permute(0, 1, 4, 2, 3, 5)      # (n, g, c, b): (c, n, g, b)
    quants = torch.cat([ql.reshape(rows, nsb, 128), qh.reshape(rows, nsb, 64), b[..., 192:208]], dim=-1)
    pad = row_bytes(nsb * SUPER_BLOCK) - nsb * GGUF_BYTES
    out = torch.cat([quants.reshape(rows, nsb * QUANT_BYTES), b[..., 208:].reshape(rows, 2 * nsb),
                     b.new_zeros(rows, pad)], dim=-1)
    return out.reshape(*lead, out.shape[-1])


def to_gguf(rows_: torch.Tensor) -> torch.Tensor:
    """Lane-order rows uint8 [..., row_bytes] -> the GGUF Q6_K rows they came from, uint8 [..., nsb * 210]. View
    ops and copies only (no index tensors from the host), so it runs inside CUDA-graph capture."""
    lead = rows_.shape[:-1]
    if rows_.dtype != torch.uint8:
        raise ValueError(f"{QTYPE} rows must be uint8, got {rows_.dtype}")
    nsb = super_blocks(rows_.shape[-1])
    r = rows_.reshape(-1, rows_.shape[-1])
    n = r.shape[0]
    q = r[:, :nsb * QUANT_BYTES].reshape(n, nsb, QUANT_BYTES)
    ql = q[..., :128].reshape(n, nsb, 2, 4, 2, 2, 4).permute(0, 1, 4, 2, 5, 3, 6)  # (h, c, n, g, b): (n, h, g, c, b)
    qh = q[..., 128:192].reshape(n, nsb, 4, 2, 2, 4).permute(0, 1, 3, 4, 2, 5)     # (c, n, g, b): (n, g, c, b)
    d = r[:, nsb * QUANT_BYTES:nsb * (QUANT_BYTES + 2)].reshape(n, nsb, 2)
    out = torch.cat([ql.reshape(n, nsb, 128), qh.reshape(n, nsb, 64), q[..., 192:208], d], dim=-1)
    return out.reshape(*lead, nsb * GGUF_BYTES)
