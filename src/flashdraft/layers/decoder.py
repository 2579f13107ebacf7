import torch
from torch import nn

from flashdraft.config import ModelConfig
from flashdraft.layers import decode_attention, qkv_prep
from flashdraft.layers.attention import Attention
from flashdraft.layers.mlp import GatedMLP
from flashdraft.layers.norm import RMSNorm
from flashdraft.layers.skinny_gemm import SkinnyLinear, fold_norm_weight, skinny_linear


class DecoderLayer(nn.Module):
    """Pre-norm transformer block shared by Qwen3, Llama and the DFlash drafter (parameter names as in HF)."""

    # > 0: cached passes of up to this many tokens run the fused kernel path (route_fused_layers)
    fused_max_t = 0
    norms_folded = False  # the two RMSNorms' weights live in the q/k/v and gate/up weights (fold_norms)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, h, cos, sin, cache_k, cache_v, positions, kv_len: int, mask: torch.Tensor | None):
        if h.shape[0] <= self.fused_max_t:
            return self.fused_forward(h, cos, sin, cache_k, cache_v, positions, kv_len, mask)
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache_k, cache_v, positions, kv_len, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def fused_forward(self, h, cos, sin, cache_k, cache_v, positions, kv_len: int, mask: torch.Tensor | None):
        """The same block in six kernel launches: four GEMMs, qkv_prep and attention. Each RMSNorm runs in the
        GEMM that reads its output (its weight folded into that GEMM's weight: fold_norms), each residual add in
        the epilogue of the GEMM that produces it, SwiGLU in the gate/up GEMM's epilogue, and q/k norm, RoPE and
        the cache writes in one kernel (layers.qkv_prep). At batch 1 the elementwise kernels and the gaps between
        launches cost a sixth of a step otherwise."""
        mlp = self.mlp
        h = self.self_attn.fused_forward(h, self.input_layernorm.eps, cos, sin, cache_k, cache_v, positions, kv_len,
                                         mask)
        act = skinny_linear(h, mlp.gate_up_weight, mlp.gate_up_bias, rms_norm_eps=self.post_attention_layernorm.eps,
                            gated=True)
        return skinny_linear(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=h)

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Move the two RMSNorms' weights into the fused q/k/v and gate/up weights (W[:, k] *= g[k]) and make the
        norms' weights ones: the same model on every path, and the fused GEMMs feed x to the tensor cores as
        loaded. Keys and values that a drafter projects from context rows without the input norm
        (Attention.context_projection) keep unfolded k/v weights of their own."""
        if self.norms_folded:
            return
        attn = self.self_attn
        if attn.context_projection:
            attn.k_proj.weight = nn.Parameter(attn.k_proj.weight.clone(), requires_grad=False)
            attn.v_proj.weight = nn.Parameter(attn.v_proj.weight.clone(), requires_grad=False)
        for norm, weight in ((self.input_layernorm, attn.qkv_weight),
                             (self.post_attention_layernorm, self.mlp.gate_up_weight)):
            fold_norm_weight(weight, norm.weight)
            norm.weight.fill_(1.0)
        self.norms_folded = True


def route_fused_layers(*models: nn.Module, on: bool = True, max_t: int = 16) -> int:
    """Send the models' cached passes of at most max_t tokens through DecoderLayer.fused_forward (on=True) or
    back to the module-by-module path. Applies to layers whose q/k/v and gate/up projections are fused plain
    weights (fuse_projections) and whose head size the attention kernels take, folding their norms' weights
    (DecoderLayer.fold_norms: permanent, and the same model on every path); returns how many were routed.
    The fused path needs the skinny GEMM, qkv_prep and decode_attention kernels, so the caller routes it only
    where those run (CUDA with Triton, or Triton's interpreter)."""
    routed = 0
    for model in models:
        for layer in model.modules():
            if not isinstance(layer, DecoderLayer):
                continue
            attn = layer.self_attn
            plain = all(type(p) in (nn.Linear, SkinnyLinear) for p in (attn.o_proj, layer.mlp.down_proj))
            ok = (plain and attn.qkv_weight is not None and layer.mlp.gate_up_weight is not None
                  and decode_attention.supports(attn.head_dim) and attn.head_dim in qkv_prep.HEAD_DIMS)
            layer.fused_max_t = max_t if on and ok else 0
            if layer.fused_max_t:
                layer.fold_norms()
            if layer.fused_max_t and getattr(layer, "_compiled_call_impl", None) is not None:
                # compiled for an earlier engine (nn.Module.compile): the fused path runs uncompiled
                layer._compiled_call_impl = None
            routed += bool(layer.fused_max_t)
    return routed
