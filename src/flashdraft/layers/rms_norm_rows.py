"""RMSNorm of a few-row pass as one Triton kernel, optionally after a residual add: the norms of a decoder layer
whose projections cannot take them into their GEMM (GGUF blocks: DecoderLayer.quant_forward).

Why: eager, elementwise.rms_norm is about seven kernels; torch.compile fuses them, but a compiled layer does not
round as eagerly and its kernels may differ with the pass's row count (on the H200 a compiled Qwen3 layer gave a
token in a 16-token block other bits than alone, which broke greedy DFlash's equality with plain decoding). Here
each row is one program over its own values only, so a token's result does not depend on the rows beside it.

Numerics (kernels.rms_norm_triton): elementwise.rms_norm's roundings, the sum of squares in the kernel's own order.
Runs on CUDA with Triton, or under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests).
"""
from __future__ import annotations

import functools

import torch

from flashdraft.kernels import programmatic

MAX_WIDTH = 1 << 15  # one block spans a row


@functools.cache
def _kernels():
    from flashdraft.kernels import rms_norm_triton
    return rms_norm_triton


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, weight * rms_norm(s)) for s = x (+ residual) in x's dtype: x and residual [T, N], weight [N] of x's dtype
    (unit stride along a row). s is x itself without a residual."""
    if x.dim() != 2 or x.shape[1] > MAX_WIDTH or x.stride(1) != 1:
        raise ValueError(f"rms_norm_rows: x must be [T, N] with unit stride along a row and N <= {MAX_WIDTH}, "
                         f"got {list(x.shape)} (strides {x.stride()})")
    T, N = x.shape
    if weight.shape != (N,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"rms_norm_rows: weight must be {x.dtype} [{N}] on {x.device}, "
                         f"got {weight.dtype} {list(weight.shape)} on {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"rms_norm_rows: residual must be {x.dtype} {list(x.shape)} with unit stride along a row, "
                         f"got {residual.dtype} {list(residual.shape)}")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    s = torch.empty_like(y) if residual is not None else x
    if T == 0:
        return s, y
    block = 1 << max(N - 1, 0).bit_length()
    r = residual if residual is not None else x
    kernel = _kernels().rms_norm_kernel
    kernel[(T,)](
        x, r, weight.contiguous(), s, y, x.stride(0), r.stride(0), s.stride(0), y.stride(0), N, eps, BLOCK=block,
        HAS_RESIDUAL=residual is not None, EMULATE=x.device.type != "cuda", num_warps=min(8, max(1, block // 512)),
        enable_fp_fusion=False,  # no FMA: the eager path rounds the sum of squares' products one by one
        **programmatic.triton_options(kernel, x.device))
    return s, y
