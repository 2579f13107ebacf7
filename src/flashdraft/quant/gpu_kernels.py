"""The GPU product of x with GGUF blocks that QuantLinear calls: one op to torch.compile'd code (opaque_op), which
takes the CUDA tensor-core kernel where it applies (Q4_K, also super-block-major, Q5_K, Q6_K;
bf16 x of at most 16 rows: decoding and speculative verify), a dequantized copy and cuBLAS for passes of many rows
(prefill; gguf_triton.dequantizes), and the Triton kernels otherwise (other types, fp32, short passes). Each reads
Q4_K_COLUMNS blocks where they lie (gguf_triton's chunk_rows)."""
from __future__ import annotations

import torch

from flashdraft.kernels import gguf_triton
from flashdraft.kernels.runtime import opaque_op
from flashdraft.quant import mma_kernels, q4k_columns


def _output_like(x, blocks, out_features, qtype, residual=None):
    return x.new_empty((*x.shape[:-1], out_features))


@opaque_op("flashdraft::quant_matmul", _output_like)
def _quant_matmul(x: torch.Tensor, blocks: torch.Tensor, out_features: int, qtype: str,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ residual: the CUDA kernel adds it in its store, the others after, the same bits)."""
    if mma_kernels.supported(x, blocks, out_features, qtype):
        return mma_kernels.launch(x, blocks, out_features, qtype, residual=residual)
    chunk_rows = 0
    if qtype == q4k_columns.QTYPE:
        qtype, chunk_rows = q4k_columns.ROWS_QTYPE, q4k_columns.CHUNK_ROWS
    if gguf_triton.dequantizes(x.numel() // max(x.shape[-1], 1), out_features, x.shape[-1], x.dtype):
        y = gguf_triton.dequantize_matmul(x, blocks, qtype, chunk_rows)
    else:
        y = gguf_triton.launch(x, blocks, out_features, qtype, chunk_rows=chunk_rows)
    return y if residual is None else y + residual


def _matmul(qtype: str):
    def matmul(x: torch.Tensor, blocks: torch.Tensor, out_features: int,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        return _quant_matmul(x, blocks, out_features, qtype, residual)

    matmul.qtype = qtype
    return matmul


KERNELS = {name: _matmul(name) for name in (*gguf_triton.QTYPE_CODES, q4k_columns.QTYPE)}


def _experts_output_like(x, blocks, experts, qtype):
    return x.new_empty((x.shape[0], blocks.shape[1]))


@opaque_op("flashdraft::expert_matmul", _experts_output_like)
def expert_matmul(x: torch.Tensor, blocks: torch.Tensor, experts: torch.Tensor, qtype: str) -> torch.Tensor:
    """Each row of x times its expert's blocks (flashdraft.quant.expert_kernels)."""
    return gguf_triton.launch_experts(x, blocks, experts, qtype)
