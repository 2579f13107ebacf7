import torch
from torch import nn

from flashdraft.layers import functional


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as the HF Qwen3/Llama reference does."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.rms_norm(x, self.weight, self.eps)
