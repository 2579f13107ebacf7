import torch
from torch import nn

from flashdraft.config import ModelConfig
from flashdraft.layers.attention import Attention
from flashdraft.layers.mlp import GatedMLP
from flashdraft.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """Pre-norm transformer block shared by Qwen3, Llama and the DFlash drafter (parameter names as in HF)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, h, cos, sin, cache_k, cache_v, positions, kv_len: int, mask: torch.Tensor | None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache_k, cache_v, positions, kv_len, mask)
        return h + self.mlp(self.post_attention_layernorm(h))
