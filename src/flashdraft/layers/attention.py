import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.config import ModelConfig
from flashdraft.layers.norm import RMSNorm
from flashdraft.layers.rope import apply_rope


class Attention(nn.Module):
    """GQA attention whose keys and values live in a preallocated cache ([kv_heads, capacity, head_dim] per layer).

    New keys/values are written at their absolute positions; attention reads the first kv_len rows.
    Rows past a query's position are stale (rolled back) or not yet written, and the mask hides them,
    which is what makes rollback free.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values for rows x: [T, hidden] -> two [kv_heads, T, head_dim]."""
        T = x.shape[0]
        k = self.k_proj(x).view(T, self.n_kv, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k.transpose(0, 1), cos, sin)
        v = self.v_proj(x).view(T, self.n_kv, self.head_dim).transpose(0, 1)
        return k, v

    def forward(self, x, cos, sin, cache_k, cache_v, positions, kv_len: int, mask: torch.Tensor | None):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(0, 1), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        cache_k.index_copy_(1, positions, k)
        cache_v.index_copy_(1, positions, v)
        out = F.scaled_dot_product_attention(
            q[None], cache_k[None, :, :kv_len], cache_v[None, :, :kv_len],
            attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out[0].transpose(0, 1).reshape(T, self.n_heads * self.head_dim))
