"""SwiGLU of a few-row pass, silu(gate) * up from the fused [gate | up] projection's output, as one Triton kernel:
the activation of a decoder layer whose projections cannot take it into their GEMM's epilogue (GGUF blocks:
DecoderLayer.quant_forward). Eager, it is two kernels (silu, then the product) and a launch gap each; every value
is computed from its own row, so a token's result does not depend on the rows beside it.

Runs on CUDA with Triton, or under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests).
"""
from __future__ import annotations

import functools

import torch

from flashdraft.kernels import programmatic

BLOCK = 1024  # features per program


@functools.cache
def _kernels():
    from flashdraft.kernels import swiglu_triton
    return swiglu_triton


def swiglu_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I] (gate the first I features of a row, up the last I; unit stride along
    a row), [T, I] in gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"swiglu_rows: gate_up must be [T, 2 * I] with unit stride along a row, got "
                         f"{list(gate_up.shape)} (strides {gate_up.stride()})")
    T, N = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty((T, N), dtype=gate_up.dtype, device=gate_up.device)
    if T and N:
        kernel = _kernels().swiglu_kernel
        kernel[(T, -(-N // BLOCK))](gate_up, y, gate_up.stride(0), y.stride(0), N, BLOCK=BLOCK,
                                    EMULATE=gate_up.device.type != "cuda",
                                    **programmatic.triton_options(kernel, gate_up.device))
    return y
