"""The DFlash drafter: a few non-causal decoder layers fed with target hidden states as injected keys/values.

Parameter names follow z-lab's checkpoints (fc, hidden_norm, norm, layers.N...). It has no embedding and no
LM head: the target's embed the block and turn its outputs into logits.
"""
from pathlib import Path

import torch
from torch import nn

from flashdraft.config import DrafterConfig
from flashdraft.loading.checkpoint import assign_tensors, check_drafter_fits, read_tensors
from flashdraft.models.kv_cache import KVCache, WindowKVCache
from flashdraft.layers import LayerPlan, RMSNorm, RotaryEmbedding
from flashdraft.models.llama.model import DecoderLayer
from flashdraft.layers.skinny_gemm import Linear, fold_norm_weight, skinny_linear
from flashdraft.quant.kv_formats import write_rows


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, max_positions: int, plan: LayerPlan = LayerPlan()):
        super().__init__()
        self.config, self.plan = cfg, plan
        c = cfg.layers
        self.fc = Linear(len(cfg.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False,
                         max_rows=plan.gemm_rows)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # context_projection: add_context runs k/v_proj over context rows (no input norm)
        self.layers = nn.ModuleList(DecoderLayer(c, plan, context_projection=True) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope = RotaryEmbedding(c, max_positions)
        # prepare(), on the fused path: per layer, [k; v] context weights with hidden_norm's weight folded in, and
        # bias; add_context calls of up to context_fused_rows rows take them
        self.context_kv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.context_fused_rows = 0

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def new_cache(self, capacity: int, k_type: str | None = None, v_type: str | None = None,
                  window: int | None = None) -> KVCache:
        """The context cache, `capacity` positions; k_type / v_type: KV cache types (None: the compute dtype).
        window: keep only the last `window` context positions (a ring of window + block rows), when smaller than
        the capacity less a block."""
        p = self.norm.weight  # a float parameter even when fc is quantized
        if window is not None and window + self.block_size < capacity:
            return WindowKVCache(self.config.layers, window, self.block_size, p.device, p.dtype, k_type, v_type)
        return KVCache(self.config.layers, capacity, p.device, p.dtype, k_type, v_type)

    def add_context(self, taps: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
        """Project target taps of committed tokens ([T, n_tap * hidden]) into every layer's cached keys/values.

        The context is shared by all layers and is not updated by them; each layer has its own k/v projections.
        """
        if isinstance(cache, WindowKVCache) and taps.shape[0] > cache.capacity:
            # rows a ring's length apart would share a row in one write; the older ones are out of the window
            taps, positions = taps[-cache.capacity:], positions[-cache.capacity:]
        cache.record(positions)
        if 0 < taps.shape[0] <= self.context_fused_rows:
            return self._add_context_fused(taps, positions, cache)
        ctx = self.hidden_norm(self.fc(taps))
        cos, sin = self.rope(positions)
        rows = cache.rows(positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            write_rows(cache.k[i], rows, k)
            write_rows(cache.v[i], rows, v)

    @torch.no_grad()
    def prepare(self) -> None:
        """Lay the loaded weights out for the plan (DecoderLayer.prepare), once. Where every layer takes the fused
        path, add_context calls of up to max_rows rows (a step's accepted tokens) go through two kernels per layer:
        a skinny GEMM of the fc output with the [k; v] weights, hidden_norm in it (its weight folded into theirs),
        and qkv_prep with no query heads (k_norm, RoPE, both cache writes). The module path costs about 15 small
        kernels per layer there, most of the extra kernel time of a DFlash step over its two passes on an H200
        (docs/performance.md)."""
        for layer in self.layers:
            layer.prepare()
        if self.context_fused_rows or not all(layer.norms_folded for layer in self.layers):
            return
        for layer in self.layers:
            attn = layer.self_attn
            weight = torch.cat([attn.k_proj.weight, attn.v_proj.weight])
            fold_norm_weight(weight, self.hidden_norm.weight)
            bias = torch.cat([attn.k_proj.bias, attn.v_proj.bias]) if attn.k_proj.bias is not None else None
            self.context_kv.append((weight, bias))
        self.context_fused_rows = self.plan.max_rows

    def _add_context_fused(self, taps: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
        fc_out = self.fc(taps)
        cos, sin = self.rope(positions)
        rows = cache.rows(positions)
        for i, (layer, (weight, bias)) in enumerate(zip(self.layers, self.context_kv)):
            kv = skinny_linear(fc_out, weight, bias, rms_norm_eps=self.hidden_norm.eps)
            layer.self_attn.write_context_kv(kv, cos, sin, rows, cache.k[i], cache.v[i])

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Block embeddings [B, hidden] at positions start..start+B-1 -> normed hidden states [B, hidden].

        kv_len = cache.kv_len(start + B). The block attends to all cached context (positions < start) and to
        itself, bidirectionally, so no mask is needed. Its own keys land in the cache at the block positions and
        are overwritten by context rows later. A caller reading more rows (a graph captured for a longer
        kv_len) passes a mask hiding the rows past the block; a window cache masks its stale rows itself.
        """
        cos, sin = self.rope(positions)
        cache.record(positions)
        if isinstance(cache, WindowKVCache):
            visible = cache.visible(kv_len, positions[-1])
            mask = visible if mask is None else mask & visible
        rows = cache.rows(positions)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.k[i], cache.v[i], rows, kv_len, mask)
        return self.norm(h)

    def forward_train(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, taps: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """Training path, batched and cache-free: the blocks of many anchors in one pass.

        block_embeds [b, Q, hidden] at block_positions [b, Q]; taps [b, S, n_tap * hidden] of context rows at
        positions 0..S-1; mask [b, Q, S + Q] (True = may attend) over the keys [context | blocks]. Context keys
        and values are projected exactly as add_context's module path does and block rows as forward does, so
        with a mask that lets each block see the context before its first position and itself, a block's outputs
        equal forward's for the same context. Returns normed hidden states [b, Q, hidden].
        """
        ctx = self.hidden_norm(self.fc(taps))
        ctx_cos, ctx_sin = self.rope(torch.arange(taps.shape[1], device=taps.device))
        cos, sin = self.rope(block_positions)
        mask = mask.unsqueeze(1)
        h = block_embeds
        for layer in self.layers:
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            ctx_k, ctx_v = attn.project_kv(ctx, ctx_cos, ctx_sin)
            k, v = attn.project_kv(x, cos, sin)
            q = attn.batched_q(x, cos, sin)
            h = h + attn.attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def load_dflash_drafter(folder: Path, target, max_positions: int, plan: LayerPlan = LayerPlan()) -> DFlashDrafter:
    """A z-lab DFlash drafter from its Hugging Face folder, on the target's device and dtype."""
    cfg = DrafterConfig.from_file(folder / "config.json")
    check_drafter_fits(cfg, target.config, folder)
    p = target.model.norm.weight  # the target's device and dtype (a float parameter even in GGUF models)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg, max_positions, plan)
    assign_tensors(drafter, read_tensors(folder), folder, p.device, p.dtype)
    drafter.rope = drafter.rope.__class__(cfg.layers, max_positions).to(p.device)
    return drafter.eval().requires_grad_(False)
