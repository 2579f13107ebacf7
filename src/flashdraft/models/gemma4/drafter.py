"""DFlash drafters for Gemma 4 targets (z-lab/gemma-4-31B-it-DFlash, z-lab/gemma-4-26B-A4B-it-DFlash).

The layer stack is the plain Qwen3-style DFlash drafter (SwiGLU, x_hat * w norms, q/k norms, head_dim^-1/2
scale, its own RoPE), with two differences:
- per-layer attention types: sliding-window layers that are causal (a block row sees context and earlier block
  rows within the window) and a non-causal full layer (the whole context and the whole block);
- block tokens are embedded as the target's first layer sees them (Gemma's sqrt(hidden) scale), unless the
  drafter's config chooses the raw embedding (block_embedding_scale "none"; see docs/gemma4.md).
Logits come from the target's head, so Gemma's final softcapping applies to the drafts as to the target.
"""
from __future__ import annotations

from pathlib import Path

import torch

from flashdraft.models.gemma4.config import Gemma4DrafterConfig
from flashdraft.layers.plan import LayerPlan
from flashdraft.models.kv_cache import KVCache, WindowKVCache
from flashdraft.loading.checkpoint import assign_tensors, model_folder, read_tensors
from flashdraft.models.llama.model import DFlashDrafter
from flashdraft.models.gemma4.model import Gemma4LM


class Gemma4DFlashDrafter(DFlashDrafter):
    config: Gemma4DrafterConfig

    def __init__(self, cfg: Gemma4DrafterConfig, max_positions: int, target_embed_scale: float = 1.0,
                 plan: LayerPlan = LayerPlan()):
        super().__init__(cfg, max_positions, plan)
        # The factor that turns the target's embeddings (which the loop hands over) into the block embeddings.
        self.block_factor = 1.0 if cfg.block_embedding_scale == "target" else 1.0 / target_embed_scale

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Block embeddings [B, hidden] (from target.embed) at positions start..start+B-1 -> normed hidden [B, hidden].
        Cache rows below start hold projected context. Without `mask`, kv_len = start + B and a sliding layer
        reads only the rows its window can reach, so its cost stays bounded as the context grows. A caller reading
        more rows (a CUDA graph captured for a longer kv_len) passes a mask hiding the rows past the block. A
        window cache (WindowKVCache) holds positions out of order: every layer reads its whole ring and masks by the
        positions its rows hold.
        """
        cfg = self.config
        h = block_embeds
        if self.block_factor != 1.0:
            h = (h.float() * self.block_factor).to(h.dtype)
        cos, sin = self.rope(positions)
        cache.record(positions)
        rows = cache.rows(positions)
        ring = isinstance(cache, WindowKVCache)
        if ring:
            held = cache.key_positions(kv_len)
            mask = _and(mask, cache.visible(kv_len, positions[-1]))
        q = positions[:, None]
        for i, layer in enumerate(self.layers):
            sliding = cfg.layer_types[i] == "sliding_attention"
            lo = max(0, kv_len - positions.shape[0] - cfg.sliding_window + 1) if sliding and mask is None else 0
            keys = held[None, :] if ring else torch.arange(lo, kv_len, device=positions.device)[None, :]
            layer_mask = None if mask is None else mask[..., lo:]
            if sliding:
                layer_mask = _and(layer_mask, q - keys < cfg.sliding_window)
            if cfg.layer_causal[i]:
                layer_mask = _and(layer_mask, keys <= q)
            h = layer(h, cos, sin, cache.k[i][:, lo:], cache.v[i][:, lo:], rows - lo, kv_len - lo, layer_mask)
        return self.norm(h)


def _and(mask: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    return other if mask is None else mask & other


def load_gemma4_drafter(path: str | Path, target: Gemma4LM, max_positions: int,
                        plan: LayerPlan = LayerPlan()) -> Gemma4DFlashDrafter:
    folder = model_folder(path, "drafter")
    cfg = Gemma4DrafterConfig.from_file(folder / "config.json")
    cfg.check_fits(target.config, folder)
    p = target.model.norm.weight
    scale = float(target.embed_scale)
    with torch.device("meta"):
        drafter = Gemma4DFlashDrafter(cfg, max_positions, scale, plan)
    assign_tensors(drafter, read_tensors(folder), folder, p.device, p.dtype)
    drafter.rope = drafter.rope.__class__(cfg.layers, max_positions).to(p.device)
    return drafter.eval().requires_grad_(False)
