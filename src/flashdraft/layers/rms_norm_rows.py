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
from flashdraft.kernels.runtime import opaque_op

MAX_WIDTH = 1 << 15  # one block spans a row


@functools.cache
def _kernels():
    from flashdraft.kernels import rms_norm_triton
    return rms_norm_triton


def _check_rows(where: str, name: str, t: torch.Tensor) -> None:
    """t must be rows [T, N] that one block of a program spans (N <= MAX_WIDTH), unit stride along a row."""
    if t.dim() != 2 or t.shape[1] > MAX_WIDTH or t.stride(1) != 1:
        raise ValueError(f"{where}: {name} must be [T, N] with unit stride along a row and N <= {MAX_WIDTH}, "
                         f"got {list(t.shape)} (strides {t.stride()})")


def _check_weight(where: str, name: str, w: torch.Tensor, x: torch.Tensor, same_dtype: bool) -> None:
    """w must be one value per column of x's rows, [N], on x's device (and of x's dtype where same_dtype)."""
    N = x.shape[1]
    if w.shape != (N,) or w.device != x.device or (same_dtype and w.dtype != x.dtype):
        want, got = (f"{x.dtype} ", f"{w.dtype} ") if same_dtype else ("", "")
        raise ValueError(f"{where}: {name} must be {want}[{N}] on {x.device}, got {got}{list(w.shape)} on {w.device}")


def _one_block_a_row(N: int) -> dict:
    """The launch sizes of a kernel whose program holds a whole row of N values in one block."""
    block = 1 << max(N - 1, 0).bit_length()
    return {"BLOCK": block, "num_warps": min(8, max(1, block // 512))}


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, weight * rms_norm(s)) for s = x (+ residual) in x's dtype: x and residual [T, N], weight [N] of x's dtype
    (unit stride along a row). s is x itself without a residual."""
    _check_rows("rms_norm_rows", "x", x)
    T, N = x.shape
    _check_weight("rms_norm_rows", "weight", weight, x, same_dtype=True)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"rms_norm_rows: residual must be {x.dtype} {list(x.shape)} with unit stride along a row, "
                         f"got {residual.dtype} {list(residual.shape)}")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    s = torch.empty_like(y) if residual is not None else x
    if T == 0:
        return s, y
    r = residual if residual is not None else x
    kernel = _kernels().rms_norm_kernel
    kernel[(T,)](
        x, r, weight.contiguous(), s, y, x.stride(0), r.stride(0), s.stride(0), y.stride(0), N, eps,
        HAS_RESIDUAL=residual is not None, EMULATE=x.device.type != "cuda", **_one_block_a_row(N),
        enable_fp_fusion=False,  # no FMA: the eager path rounds the sum of squares' products one by one
        **programmatic.triton_options(kernel, x.device))
    return s, y


def _gemma_launch(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                  scalar: torch.Tensor | None,
                  next_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_rows("gemma norms", "x", x)
    if h is not None:
        _check_rows("gemma norms", "h", h)
        if h.shape != x.shape or h.dtype != x.dtype or h.device != x.device:
            raise ValueError(f"gemma norms: h must be {x.dtype} {list(x.shape)} on {x.device}, "
                             f"got {h.dtype} {list(h.shape)} on {h.device}")
    T, N = x.shape
    for name, w in (("weight", weight), ("next_weight", next_weight)):
        if w is not None:
            _check_weight("gemma norms", name, w, x, same_dtype=False)
    if scalar is not None and (scalar.numel() != 1 or scalar.device != x.device):
        raise ValueError(f"gemma norms: scalar must be one value on {x.device}, got {list(scalar.shape)} on "
                         f"{scalar.device}")
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty_like(s) if next_weight is not None else None
    if T == 0:
        return s, y
    # a pointer the kernel does not read or write (no residual, weight, scalar or next norm) is any tensor's
    y_out = y if y is not None else s
    kernel = _kernels().gemma_norms_kernel
    kernel[(T,)](
        x, h if h is not None else x, weight.contiguous() if weight is not None else x,
        scalar if scalar is not None else x, next_weight.contiguous() if next_weight is not None else x, s, y_out,
        x.stride(0), h.stride(0) if h is not None else 0, s.stride(0), y_out.stride(0), N, eps,
        ADD=h is not None, WEIGHT=weight is not None, SCALE=scalar is not None, NEXT=next_weight is not None,
        EMULATE=x.device.type != "cuda", **_one_block_a_row(N),
        enable_fp_fusion=False,  # no FMA: each product rounds as torch's does
        **programmatic.triton_options(kernel, x.device))
    return s, y


def _two_like(x, h, weight, next_weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@opaque_op("flashdraft::gemma_add_norm", _two_like)
def _gemma_add_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _gemma_launch(x, h, weight, eps, None, next_weight)


def gemma_add_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s) next_weight) for s = h + norm(x) weight, Gemma4RMSNorm's norms: x [T, N] a layer's attention
    output and h its residual [T, N]; s is the residual after attention, the second the feed-forward's input.
    One kernel (kernels.rms_norm_triton.gemma_norms_kernel), one program a row: a row's bits do not depend on the
    rows beside it, where a compiled layer's reductions may be tiled by the pass's row count."""
    return _gemma_add_norm(x, h, weight, next_weight, eps)


def _two_scaled_like(x, h, weight, scalar, next_weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@opaque_op("flashdraft::gemma_add_scaled_norm", _two_scaled_like)
def _gemma_add_scaled_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, scalar: torch.Tensor,
                           next_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _gemma_launch(x, h, weight, eps, scalar, next_weight)


def gemma_add_scaled_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, scalar: torch.Tensor,
                          next_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s) next_weight) for s = (h + norm(x) weight) * scalar, Gemma4RMSNorm's norms: x [T, N] a layer's
    feed-forward output, h its residual, scalar [1] the layer's scalar; s is the layer's output, the second the
    next layer's input (next_weight its input norm's; after the last layer, the final norm's). The second norm is
    gemma_norm(s, next_weight)'s bits: the same arithmetic on the same rounded s. One kernel, one program a row
    (gemma_add_norm)."""
    return _gemma_add_scaled_norm(x, h, weight, scalar, next_weight, eps)


def _norm_like(x, weight, eps):
    return torch.empty_like(x)


@opaque_op("flashdraft::gemma_norm", _norm_like)
def _gemma_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _gemma_launch(x, None, weight, eps, None, None)[0]


def gemma_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """norm(x) weight (norm(x) without a weight), Gemma4RMSNorm: x [T, N]. One kernel, one program a row
    (gemma_add_norm): a Gemma4RMSNorm's few-row passes."""
    return _gemma_norm(x, weight, eps)


def _add_like(x, h, weight, eps):
    return torch.empty_like(x)


@opaque_op("flashdraft::gemma_add", _add_like)
def _gemma_add(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _gemma_launch(x, h, weight, eps, None, None)[0]


def gemma_add(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h + norm(x) weight, Gemma4RMSNorm's norm: x, h [T, N]. One kernel, one program a row (gemma_add_norm): an
    MoE layer's two feed-forward branches joined (h the routed experts' normed output, x the shared MLP's)."""
    return _gemma_add(x, h, weight, eps)
