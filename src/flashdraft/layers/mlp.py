import torch
from torch import nn

from flashdraft.layers import functional
from flashdraft.layers.skinny_gemm import linear


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    skinny_max_m = 0  # > 0: the fused gate/up product of up to this many rows runs skinny_gemm (route_linears)

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_weight = None

    def fuse_projections(self) -> None:
        """One [2 * intermediate, hidden] matrix for gate and up (one GEMM per step instead of two); the
        gate_proj/up_proj weights become views of it, so no memory is added."""
        fused = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        n = self.gate_proj.weight.shape[0]
        self.gate_proj.weight = nn.Parameter(fused[:n], requires_grad=False)
        self.up_proj.weight = nn.Parameter(fused[n:], requires_grad=False)
        self.gate_up_weight = fused
        self.gate_up_bias = (torch.cat([self.gate_proj.bias, self.up_proj.bias])
                             if self.gate_proj.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight, self.gate_up_bias, self.skinny_max_m).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(functional.silu_mul(gate, up))
