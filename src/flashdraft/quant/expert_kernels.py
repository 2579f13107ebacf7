"""Which experts' blocks the GPU multiplies pair by pair, and the call that does it (QuantGemma4Experts' pair
products): the kernel's module, flashdraft.quant.gpu_kernels, imports Triton, so it is imported at the first
call, as QuantLinear's products are."""
from __future__ import annotations

import torch

from flashdraft.kernels.runtime import triton_available
from flashdraft.quant import q6k_lanes

# the block types gguf_triton's kernels read (its QTYPE_CODES; a test holds the two equal)
PAIR_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K_LANES"})


def reads(qtype: str) -> bool:
    """Whether the pair products take experts held in this GGUF type (Q6_K: in lane order, as they keep it)."""
    return q6k_lanes.kept_qtype(qtype) in PAIR_TYPES


def pair_products_run_on(device: torch.device | str) -> bool:
    """Whether experts loaded onto `device` multiply pairs on the GPU: CUDA, with Triton."""
    return torch.device(device).type == "cuda" and triton_available()


def expert_matmul(x: torch.Tensor, blocks: torch.Tensor, experts: torch.Tensor, qtype: str) -> torch.Tensor:
    """y[p] = x[p] @ W[experts[p]]^T for expert blocks uint8 [E, N, row_bytes] of qtype (gguf_triton.launch_experts;
    one op inside torch.compile'd code)."""
    from flashdraft.quant import gpu_kernels

    return gpu_kernels.expert_matmul(x, blocks, experts, qtype)
