"""GGML block formats: how many weights a block holds and how many bytes it takes (ggml-common.h)."""
from __future__ import annotations

from dataclasses import dataclass

from flashdraft.quant import q4k_columns, q6k_lanes


class UnsupportedQuantType(ValueError):
    """A tensor type we cannot dequantize; the message names it."""


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int      # the GGMLQuantizationType value stored in GGUF files
    block_elems: int    # weights per block (blocks run along a row, i.e. along K of a Linear)
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        if k % self.block_elems:
            raise ValueError(f"{self.name}: row length {k} is not a multiple of the block size {self.block_elems}")
        return k // self.block_elems * self.block_bytes


# Quantized types with a torch dequantizer (flashdraft.quant.dequant). Floats (F32/F16/BF16) are not here:
# they load as ordinary float tensors.
QUANT_FORMATS = {f.name: f for f in (
    BlockFormat("Q4_0", 2, 32, 18),
    BlockFormat("Q4_1", 3, 32, 20),
    BlockFormat("Q5_0", 6, 32, 22),
    BlockFormat("Q5_1", 7, 32, 24),
    BlockFormat("Q8_0", 8, 32, 34),
    BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q5_K", 13, 256, 176),
    BlockFormat("Q6_K", 14, 256, 210),
)}


def block_format(name: str) -> BlockFormat:
    try:
        return QUANT_FORMATS[name]
    except KeyError:
        raise UnsupportedQuantType(
            f"unsupported GGUF quantization type {name} (supported: F32, F16, BF16, "
            f"{', '.join(QUANT_FORMATS)})") from None


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of a row of k weights held as qtype: GGUF's blocks, the lane-order rows of Q6_K_LANES, or Q4_K's
    row size for Q4_K_COLUMNS (the same bytes, super-block-major)."""
    if qtype == q6k_lanes.QTYPE:
        return q6k_lanes.row_bytes(k)
    return block_format(q4k_columns.file_type(qtype)).row_bytes(k)
