import torch
from torch import nn

from flashdraft.layers import functional
from flashdraft.layers.plan import LayerPlan
from flashdraft.layers.skinny_gemm import Linear, linear


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, plan: LayerPlan = LayerPlan()):
        super().__init__()
        self.gemm_rows = plan.gemm_rows  # the fused gate/up product of up to this many rows runs skinny_gemm
        self.gate_proj = Linear(hidden, intermediate, bias=bias, max_rows=plan.gemm_rows)
        self.up_proj = Linear(hidden, intermediate, bias=bias, max_rows=plan.gemm_rows)
        self.down_proj = Linear(intermediate, hidden, bias=bias, max_rows=plan.gemm_rows)
        self.gate_up_weight = None

    def fuse_projections(self) -> None:
        """One [2 * intermediate, hidden] matrix for gate and up (one GEMM per step instead of two); the
        gate_proj/up_proj weights become views of it, so no memory is added. Plain float projections only;
        done once."""
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if self.gate_up_weight is not None or not all(type(p) is Linear for p in projections):
            return
        fused = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        n = self.gate_proj.weight.shape[0]
        self.gate_proj.weight = nn.Parameter(fused[:n], requires_grad=False)
        self.up_proj.weight = nn.Parameter(fused[n:], requires_grad=False)
        self.gate_up_weight = fused
        self.gate_up_bias = (torch.cat([self.gate_proj.bias, self.up_proj.bias])
                             if self.gate_proj.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight, self.gate_up_bias, self.gemm_rows).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(functional.silu_mul(gate, up))
