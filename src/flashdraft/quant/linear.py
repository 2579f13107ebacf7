"""Linear and Embedding layers whose weights stay in their GGUF blocks (uint8), bit-faithful to the file.

The blocks are the only copy of a weight. GGUF's Q6_K blocks are re-laid out as they come in (Q6_K_LANES,
flashdraft.quant.q6k_lanes: the same bytes in the order the GPU kernels load them), and so are a projection's Q4_K
blocks of whole 256-row chunks (Q4_K_COLUMNS, flashdraft.quant.q4k_columns: super-block-major, for the CUDA kernel's
reads); the other types stay as the file has them. A forward dequantizes them per call (CPU, and any type without
a GPU kernel) and runs an ordinary matmul, so the result is exactly that of an nn.Linear holding the dequantized
weight. On CUDA, `gpu_matmul` may supply a kernel that reads the blocks directly; it must compute the same product,
batch-invariantly, for plain decoding and speculative verify to agree.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.quant import q4k_columns, q6k_lanes
from flashdraft.quant.dequant import dequantize
from flashdraft.quant.formats import row_bytes


_NO_GPU_KERNELS: list[ImportError] = []  # the kernels' import failed once (no Triton): not tried on every call


def gpu_matmul(qtype: str, device: torch.device):
    """The GPU kernel of x @ blocks^T for this type (flashdraft.quant.gpu_kernels), or None: not CUDA, or no
    Triton. The kernels' module is imported on a GPU's first product only (it imports Triton). No functools cache
    here: compiled layers trace this call, and dynamo warned of every cached function it traced."""
    if device.type != "cuda" or _NO_GPU_KERNELS:
        return None
    try:
        from flashdraft.quant import gpu_kernels
    except ImportError as e:
        _NO_GPU_KERNELS.append(e)
        return None
    return gpu_kernels.KERNELS.get(qtype)


def _stored_blocks(blocks: torch.Tensor, qtype: str, row_elems: int,
                   by_columns: bool = False) -> tuple[torch.Tensor, str]:
    """The blocks as a module keeps them, and their type: checked, Q6_K put in lane order, and with by_columns Q4_K
    of whole chunks of rows put super-block-major."""
    expected = (blocks.shape[0], row_bytes(qtype, row_elems))
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or tuple(blocks.shape) != expected:
        raise ValueError(f"{qtype} blocks must be uint8 {list(expected)}, got {blocks.dtype} {list(blocks.shape)}")
    if qtype == q4k_columns.QTYPE and not q4k_columns.fits(blocks.shape[0]):
        raise ValueError(f"{qtype} blocks come in chunks of {q4k_columns.CHUNK_ROWS} rows, got {blocks.shape[0]} rows")
    if by_columns and qtype == q4k_columns.ROWS_QTYPE and q4k_columns.fits(blocks.shape[0]):
        return q4k_columns.from_rows(blocks), q4k_columns.QTYPE
    kept = q6k_lanes.kept_qtype(qtype)
    return (blocks if kept == qtype else q6k_lanes.from_gguf(blocks)), kept


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W [out_features, in_features] held as GGUF blocks uint8 [out_features, row_bytes]
    (qtype: the file's type, or Q6_K_LANES / Q4_K_COLUMNS for blocks already so laid out; self.qtype is the type
    kept). by_columns puts Q4_K blocks of whole 256-row chunks super-block-major (a copy; the loader asks for it
    for a file's projections); without it the blocks are kept as given (a view: a tied LM head's embedding blocks,
    a slice of a fused projection's rows)."""

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, dtype: torch.dtype,
                 bias: torch.Tensor | None = None, by_columns: bool = False):
        super().__init__()
        blocks, self.qtype = _stored_blocks(blocks, qtype, in_features, by_columns)
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.dtype = dtype  # the compute dtype: activations and the dequantized weight
        self.register_buffer("blocks", blocks)
        self.bias = nn.Parameter(bias.to(dtype), requires_grad=False) if bias is not None else None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, materialized on every access (for code that needs a dense tensor)."""
        return dequantize(self.blocks, self.qtype).to(self.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b) (+ residual): given a residual (the block's stream, after its last projection), the sum is
        that of `y + residual`; the GPU kernel adds it as it stores y, where there is no bias."""
        kernel = gpu_matmul(self.qtype, self.blocks.device)
        if kernel is None:
            y = F.linear(x, self.weight, self.bias)
        elif self.bias is None:
            return kernel(x, self.blocks, self.out_features, residual)
        else:
            y = kernel(x, self.blocks, self.out_features) + self.bias
        return y if residual is None else y + residual

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


class QuantEmbedding(nn.Module):
    """Token embedding rows held as GGUF blocks; only the rows looked up are dequantized."""

    def __init__(self, blocks: torch.Tensor, qtype: str, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        if qtype == q4k_columns.QTYPE:
            raise ValueError(f"an embedding looks its rows up one by one: its blocks must be in GGUF's row order "
                             f"({q4k_columns.ROWS_QTYPE}), not {qtype}")
        blocks, self.qtype = _stored_blocks(blocks, qtype, embedding_dim)
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.dtype = dtype
        self.register_buffer("blocks", blocks)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.blocks, self.qtype).to(self.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return dequantize(self.blocks[tokens], self.qtype).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"
