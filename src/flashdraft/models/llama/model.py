"""Decoder-only language model over a static KV cache: the Qwen3 and Llama-3.x targets.

Module and parameter names follow HF (model.embed_tokens, model.layers.N..., model.norm, lm_head), so a
checkpoint's state dict loads as is. Qwen3 differs from Llama only in per-head q/k RMSNorm (ModelConfig.qk_norm)
and its explicit head_dim; both come from config.json, so one class serves both families.
"""
import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from flashdraft.config import ModelConfig
from flashdraft.models.kv_cache import KVCache
from flashdraft.layers import DecoderLayer, LayerPlan, RMSNorm, RotaryEmbedding
from flashdraft.layers.skinny_gemm import Linear


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, plan) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, plan: LayerPlan = LayerPlan()):
        super().__init__()
        self.config, self.plan = cfg, plan
        self.model = DecoderStack(cfg, plan)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, max_rows=plan.gemm_rows)
        self.rope = RotaryEmbedding(cfg, max_positions)

    def prepare(self) -> None:
        """Lay the loaded weights out for the plan (DecoderLayer.prepare); once, before the model runs."""
        for layer in self.model.layers:
            layer.prepare()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the first layer sees them (the drafter embeds its block with this too)."""
        return self.model.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits from final hidden states that are already normed (the drafter's outputs are)."""
        return self.lm_head(hidden).float()

    def new_cache(self, capacity: int, k_type: str | None = None, v_type: str | None = None) -> KVCache:
        """A cache of `capacity` positions; k_type / v_type: KV cache types (None: the compute dtype)."""
        p = self.model.norm.weight  # a float parameter even when the projections are quantized
        return KVCache(self.config, capacity, p.device, p.dtype, k_type, v_type)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
                tap_ids: list[int] | None = None, logits_row: torch.Tensor | None = None, causal: bool = False):
        """Run tokens [T] at absolute positions [T] (ascending), reading cache rows [0, kv_len).
        causal: the positions are kv_len - T .. kv_len - 1 (an eager prefill pass), so a pass longer than the
        few-row paths take attends causally from the lower right with no mask: SDPA's flash kernel, where a boolean
        mask [T, kv_len], tiled per query group, took the memory-efficient kernel and a float bias of that size.

        Returns float32 logits [T, vocab] (or [1, vocab] of row logits_row alone: a prefill pass wants its last real
        row's) and, if tap_ids is given, the outputs of those decoder layers concatenated in list order
        ([T, len(tap_ids) * hidden]) else None.
        Tap id i is the output of decoder layer i (HF hidden_states[i + 1]).
        """
        cos, sin = self.rope(positions)
        if causal and tokens.shape[0] > self.plan.max_rows:
            mask = causal_lower_right(tokens.shape[0], kv_len)
        else:  # causal by absolute position: a query sees cache rows at or before its own position
            mask = torch.arange(kv_len, device=positions.device)[None, :] <= positions[:, None]
        h = self.embed(tokens)
        taps = {}
        wanted = set(tap_ids or ())
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, cache.k[i], cache.v[i], positions, kv_len, mask)
            if i in wanted:
                taps[i] = h
        if logits_row is not None:  # a [1] index on the device: a graphed pass's varies from replay to replay
            h = h.index_select(0, logits_row)
        logits = self.logits(self.model.norm(h))
        tap_out = torch.cat([taps[i] for i in tap_ids], dim=-1) if tap_ids else None
        return logits, tap_out
