"""Q4_K weights super-block-major in chunks of rows (Q4_K_COLUMNS): GGUF's Q4_K bytes, re-laid out once as the
loader builds its QuantLinear (by_columns), so that the warps of a product, which move through K together, read
long stretches of memory in order.

In GGUF's row-major order a warp's step reads one 144-byte super-block from each of its tile's rows, rows K / 256 *
144 bytes apart. Here the weight's rows come in chunks of CHUNK_ROWS, and within a chunk the super-blocks of all its
rows at one K position lie one after the other:

    [N / CHUNK_ROWS][nsb][CHUNK_ROWS][144 bytes]: row n's super-block sb at
        (n // CHUNK_ROWS) * CHUNK_ROWS * nsb * 144 + (sb * CHUNK_ROWS + n % CHUNK_ROWS) * 144

so at a super-block the warps of a chunk read its 36,864 bytes in order. Whole-weight super-block-major order
([nsb][N][144]) read Gemma-4-31B's gate|up (43008 x 5376) at one row in 58.0 us instead of 63.9 on an H100, the same
bits (scripts/gpu/q4k_layout_probe.py --layout columns; docs/performance.md, session 45). Chunks keep what rows
need of a weight: a chunk-aligned run of rows is a contiguous run of bytes in the same layout, so fused projections
(torch.cat of their parts, each a whole number of chunks) and the parts' views of them stay views, and a
projection of some of a fused weight's rows (the [k; v] rows) is a slice. CHUNK_ROWS is 256, which divides every
Q4_K weight of Gemma 4 and Qwen3 that the tensor-core kernel multiplies; weights of other row counts stay in GGUF's
order (Q4_K).

The tensor keeps the row-major one's shape, uint8 [N, nsb * 144], so a QuantLinear's sizes read as before; rows
may be sliced only at chunk boundaries and never gathered (QuantEmbedding refuses it). The CUDA tensor-core kernel
(kquant_mma.cu, COLUMNS) and the Triton kernels (gguf_triton: the packed product and the dequantization of prefill
passes, chunk_rows) read the layout where it lies; only the CPU's dequantization puts the rows back first
(to_rows).
"""
from __future__ import annotations

import torch

QTYPE = "Q4_K_COLUMNS"
ROWS_QTYPE = "Q4_K"
BLOCK_BYTES = 144
CHUNK_ROWS = 256


def file_type(qtype: str) -> str:
    """The GGUF type of blocks kept as qtype: Q4_K for Q4_K_COLUMNS, else qtype."""
    return ROWS_QTYPE if qtype == QTYPE else qtype


def fits(rows: int) -> bool:
    """Whether a Q4_K weight of this many rows is stored super-block-major (a whole number of chunks)."""
    return rows > 0 and rows % CHUNK_ROWS == 0


def _checked(blocks: torch.Tensor, qtype: str) -> tuple[int, int]:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % BLOCK_BYTES or not fits(blocks.shape[0]):
        raise ValueError(f"{qtype} blocks must be uint8 [N, a multiple of {BLOCK_BYTES}] with N a positive multiple "
                         f"of {CHUNK_ROWS}, got {blocks.dtype} {list(blocks.shape)}")
    return blocks.shape[0], blocks.shape[1] // BLOCK_BYTES


def from_rows(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_K rows uint8 [N, nsb * 144] -> the same bytes chunked super-block-major, a new tensor of that shape."""
    n, nsb = _checked(blocks, ROWS_QTYPE)
    chunks = blocks.reshape(n // CHUNK_ROWS, CHUNK_ROWS, nsb, BLOCK_BYTES).transpose(1, 2)
    return chunks.contiguous().reshape(n, nsb * BLOCK_BYTES)


def to_rows(blocks: torch.Tensor) -> torch.Tensor:
    """Chunked super-block-major uint8 [N, nsb * 144] -> GGUF's Q4_K rows, a new tensor of that shape. View ops and
    one copy (no index tensors from the host): it runs inside CUDA-graph capture."""
    n, nsb = _checked(blocks, QTYPE)
    chunks = blocks.reshape(n // CHUNK_ROWS, nsb, CHUNK_ROWS, BLOCK_BYTES).transpose(1, 2)
    return chunks.contiguous().reshape(n, nsb * BLOCK_BYTES)
