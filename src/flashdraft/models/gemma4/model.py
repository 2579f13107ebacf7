"""The Gemma 4 text decoder (31B dense, 26B-A4B mixture of experts) over static caches.

What differs from Llama/Qwen3, each of which silently ruins the output if missed:
- embeddings are scaled by sqrt(hidden), the scale first rounded to the weight dtype (73.5 in bf16 for the 31B);
- per-layer attention types: sliding-window layers (their own head shape and default RoPE) and full layers (wider
  heads, "proportional" partial RoPE, and with attention_k_eq_v no v_proj: the raw key projection is the value);
- q/k RMSNorm with weights, a weightless v norm, attention scale 1.0, no attention softcap;
- four sandwich norms per layer, GeGLU (tanh gelu), and a per-layer `layer_scalar` multiplying the whole residual;
- RMSNorm is x_hat * w (no Gemma 1-3 `1 + w` offset);
- the 26B-A4B adds a router (weightless norm, scale, per-expert scale, top-k of softmax, renormalised), experts
  and an always-on dense MLP, with three extra norms;
- final logit softcapping (30 * tanh(logits / 30)) through the tied embedding.

Module and parameter names follow transformers' Gemma4TextModel, so checkpoint tensors load by name once the
multimodal prefix (model.language_model.) is mapped to model.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from flashdraft.config import read_json
from flashdraft.models.gemma4.config import FULL, SLIDING, Gemma4Config, RopeSpec
from flashdraft.models.kv_cache import HostArena, check_same_types, copy_all_to, copy_rows, device_of
from flashdraft.models.llama.model import GatedMLP
from flashdraft.layers import decode_attention as attention_kernel
from flashdraft.layers.attention import grouped_attention
from flashdraft.layers.decode_attention import decode_attention
from flashdraft.layers.plan import LayerPlan
from flashdraft.layers.qkv_prep import HEAD_DIMS as PREP_HEAD_DIMS, qkv_prep
from flashdraft.layers.rms_norm_rows import gemma_add, gemma_add_norm, gemma_add_scaled_norm, gemma_norm
from flashdraft.layers.skinny_gemm import Linear, attach_fused
from flashdraft.loading.checkpoint import CheckpointError, assign_tensors, default_device_dtype, safetensors_files
from flashdraft.quant.kv_formats import as_stored, bytes_per_token, cache_format, new_rows, read_rows, write_rows

# Sliding-window layers keep window + RING_OVERHANG rows (row = position % rows). A call of T rows rolled back to
# any of its positions still finds every row its window needs while T <= RING_OVERHANG + 2. The engine's verify
# blocks are at most generator.MAX_BLOCK_SIZE (64) rows; a test pins RING_OVERHANG >= it.
RING_OVERHANG = 64
# Passes of at most this many tokens write their rows into the ring before attending and read the ring in place:
# a row written overwrites a position at least window + RING_OVERHANG - T + 1 > window older than any query of the
# call, so nothing a query needs is lost. Longer passes (prefill) attend over [ring | their own rows].
RING_IN_PLACE_MAX_T = RING_OVERHANG
# Stored position of a ring row never written: far enough below any query that the window excludes it.
_EMPTY = -(2 ** 40)


class Gemma4RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-1/2 (* w), in float32 and cast back, as transformers' Gemma4RMSNorm. An input of at
    most `rows` tokens along dim 0 (a few-row pass: the plan's attention_rows) goes through one row kernel
    (rms_norm_rows.gemma_norm, one program a row), where the reduction's code, compiled or eager, may follow the
    row count and round a token otherwise alone than in a verify block (docs/performance.md, session 45)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_weight: bool = True, rows: int = 0):
        super().__init__()
        self.eps, self.rows = eps, rows
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.rows:
            return gemma_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.type_as(x)


def rope_inverse_frequencies(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies over the whole head. "proportional" rotates only the first
    partial_rotary_factor of the pairs, with exponents over the FULL head_dim; the other pairs get 0 (identity).
    Computed on the CPU, also while a model is being built on the meta device."""
    cpu = torch.device("cpu")
    if spec.rope_type == "default":
        return 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=cpu) / head_dim))
    angles = int(spec.partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / (spec.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float, device=cpu) / head_dim))
    return torch.cat([rotated, torch.zeros(head_dim // 2 - angles, device=cpu)]) / spec.factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (rotate-half layout)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def embedding_scale(hidden_size: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """sqrt(hidden) rounded to the weight dtype, as the checkpoint was trained (73.5, not 73.32, in bf16)."""
    return torch.tensor(math.sqrt(hidden_size), device=device).to(dtype)


class Gemma4Cache:
    """Static keys/values for one sequence.

    Full layers: [kv_heads, capacity, head_dim] rows at absolute positions, valid below kv_len (as KVCache).
    Sliding layers: a ring of window + RING_OVERHANG rows, row = position % ring; `ring_pos` records which position
    each row holds, and attention masks by those stored positions: rows at or after the call's first position are
    stale (rolled back or being rewritten) and hidden. Rollback is thus O(1), as for full layers, and a call
    repeated at the same positions (CUDA-graph warm-up, then capture) gives the same result. A ring row is lost
    only when a later position overwrites it, which RING_OVERHANG rules out for rollbacks within one verify block
    and for a prefill pass's filler rows (filler_rows).
    Nothing here needs the host to know the current length, so the forward pass can be captured as a CUDA graph.
    """

    def __init__(self, cfg: Gemma4Config, capacity: int, device, dtype, k_type: str | None = None,
                 v_type: str | None = None):
        self.capacity = capacity
        self.ring = min(capacity, cfg.sliding_window + RING_OVERHANG)
        self.window = cfg.sliding_window
        self.k_format, self.v_format = cache_format(k_type, dtype), cache_format(v_type, dtype)
        self.k, self.v = [], []
        for i in range(cfg.num_hidden_layers):
            rows = self.ring if cfg.is_sliding(i) else capacity
            heads, hd = cfg.layer_kv_heads[i], cfg.layer_head_dims[i]
            self.k.append(new_rows(self.k_format, heads, rows, hd, device))
            self.v.append(new_rows(self.v_format, heads, rows, hd, device))
        # the layers whose rows grow with the context (the sliding rings' size is fixed)
        self.full_shapes = [(cfg.layer_kv_heads[i], cfg.layer_head_dims[i])
                            for i in range(cfg.num_hidden_layers) if not cfg.is_sliding(i)]
        self.ring_pos = torch.full((self.ring,), _EMPTY, device=device, dtype=torch.long)
        self._sliding = [cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)]

    def reusable(self, rows: int) -> int:
        """How many of the first `rows` positions a new sequence that shares them can keep: all, if the ring still
        holds the window before `rows`; else none (a sliding layer cannot rebuild a row once overwritten)."""
        if rows == 0:
            return 0
        wanted = torch.arange(max(0, rows - self.window), rows, device=self.ring_pos.device)
        return rows if bool((self.ring_pos[wanted % self.ring] == wanted).all()) else 0

    def filler_rows(self, end: int) -> int:
        """The most filler rows (a prefill pass padded to a bucket) a pass may write at positions end, end + 1, ...:
        within the capacity, and on the rings either before they come round or within their RING_OVERHANG rows past
        the window. Filler at position p takes the ring slot of position p - ring, older than the window of any
        query from `end` on, as a rejected verify block's rows do; like those, the rows hold positions past the
        sequence's length, stale and hidden until real rows replace them."""
        return min(self.capacity - end, max(self.ring - end, self.ring - self.window))

    def copy_prefix(self, source: "Gemma4Cache", rows: int) -> None:
        """Take positions [0, rows) from another sequence's cache (one that shares those tokens and for which
        source.reusable(rows) == rows). Sliding layers take the whole ring: rows it holds at or past `rows` are
        stale for this sequence, and hidden as rolled-back rows are until overwritten."""
        check_same_types(self, source)
        for sliding, dst_k, dst_v, src_k, src_v in zip(self._sliding, self.k, self.v, source.k, source.v):
            if sliding:
                dst_k.copy_(src_k, non_blocking=True)
                dst_v.copy_(src_v, non_blocking=True)
            else:
                copy_rows(dst_k, src_k, rows)
                copy_rows(dst_v, src_v, rows)
        self.ring_pos.copy_(source.ring_pos)

    def snapshot(self, rows: int, device: torch.device | str | HostArena = "cpu") -> Gemma4Cache:
        """A copy of positions [0, rows) on `device` (KVCache.snapshot): the full layers' first rows and the
        whole rings with the positions they hold, which copy_prefix takes as a source."""
        snap = copy.copy(self)
        snap.capacity = rows
        snap.ring_pos = self.ring_pos.to(device_of(device), copy=True)  # waited for: reusable() reads it on the host
        taken = [t if sliding else t[:, :rows] for sliding, t in zip(self._sliding * 2, self.k + self.v)]
        copies = copy_all_to(taken, device)
        snap.k, snap.v = copies[:len(self.k)], copies[len(self.k):]
        return snap

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_per_token(self) -> int:
        """Cache bytes each further position of context takes: the full layers' rows (the rings hold a fixed
        window + RING_OVERHANG rows whatever the context)."""
        return bytes_per_token(self.full_shapes, self.k_format, self.v_format)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int, plan: LayerPlan):
        super().__init__()
        self.sliding = cfg.is_sliding(layer)
        self.n_heads = cfg.num_attention_heads
        self.n_kv, self.head_dim = cfg.layer_kv_heads[layer], cfg.layer_head_dims[layer]
        # passes of up to this many tokens run decode_attention (where it takes the head size)
        self.attention_rows = plan.attention_rows if attention_kernel.supports(self.head_dim) else 0
        # ... and of those, the ones that write the ring in place (every one over a full layer's cache) take the
        # norms, RoPE and cache writes as one kernel (qkv_prep) where q/k/v are one product (or q|k is, beside a v
        # of another type) and the cache holds the compute dtype or a block type: compiled, they were five kernels
        # a layer (docs/performance.md)
        self.prep_rows = 0 if self.head_dim not in PREP_HEAD_DIMS else (
            min(self.attention_rows, RING_IN_PLACE_MAX_T) if self.sliding else self.attention_rows)
        h, bias, rows = cfg.hidden_size, cfg.attention_bias, plan.gemm_rows
        self.q_proj = Linear(h, self.n_heads * self.head_dim, bias=bias, max_rows=rows)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, bias=bias, max_rows=rows)
        self.v_proj = None if cfg.uses_k_as_v(layer) else Linear(h, self.n_kv * self.head_dim, bias=bias,
                                                                  max_rows=rows)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=bias, max_rows=rows)
        # each head's norms, where qkv_prep does not take them (a few-row pass's: one row kernel)
        self.q_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps, rows=plan.attention_rows)
        self.k_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps, rows=plan.attention_rows)
        self.v_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps, with_weight=False, rows=plan.attention_rows)
        self.qkv_proj = None  # q, k (and v) as one projection, once fuse_projections() found them alike
        self.qk_proj = None  # else q and k as one, beside a v of another type

    def fuse_projections(self) -> None:
        """q, k and v (k alone under attention_k_eq_v) as one projection where they are alike (fuse_rows): one
        product a pass instead of three, and one large one keeps the GPU's multiprocessors busier than three
        small ones. Where v is of another type (a Q4_K_S file's Q5_K attn_v in its first layers), q and k as one.
        Done once."""
        if self.qkv_proj is None and self.qk_proj is None:
            attach_fused(self, "qkv_proj", [p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None])
            if self.qkv_proj is None and self.v_proj is not None:
                attach_fused(self, "qk_proj", [self.q_proj, self.k_proj])

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.qk_proj is not None:
            q, k = self.qk_proj(x).split([self.n_heads * self.head_dim, self.n_kv * self.head_dim], dim=-1)
            return q, k, self.v_proj(x)
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), None if self.v_proj is None else self.v_proj(x)
        kv, has_v = self.n_kv * self.head_dim, self.v_proj is not None
        parts = self.qkv_proj(x).split([self.n_heads * self.head_dim, kv] + [kv] * has_v, dim=-1)
        return parts[0], parts[1], parts[2] if has_v else None

    def forward(self, x, cos, sin, cache_k, cache_v, ring: int, positions, kv_len: int, mask) -> torch.Tensor:
        """cache_k / cache_v: this layer's rows of the cache (a ring of `ring` rows on a sliding layer). The layer's
        own tensors, not the cache and an index, so that one compiled graph serves every layer of a kind."""
        T = x.shape[0]
        stored = (x.dtype, torch.uint8)  # rows qkv_prep writes: of the compute dtype, or a block type's
        fused = self.qkv_proj is not None or self.qk_proj is not None
        if T <= self.prep_rows and fused and cache_k.dtype in stored and cache_v.dtype in stored:
            # a v of another type is read from its own product, not copied beside q|k
            qkv, v = (self.qkv_proj(x), None) if self.qkv_proj is not None else (self.qk_proj(x), self.v_proj(x))
            q = qkv_prep(qkv, cos, sin, positions, cache_k, cache_v, self.n_heads, self.n_kv, self.q_norm.weight,
                         self.k_norm.weight, self.q_norm.eps, gemma=True, value_is_key=self.v_proj is None,
                         wrap=self.sliding, v=v)
            keys, values, mask = self._in_place(cache_k, cache_v, ring, kv_len, mask)
            return self.o_proj(decode_attention(q.transpose(0, 1), keys, values, mask, scale=1.0))
        q, k, v = self._qkv(x)
        q = apply_rope(self.q_norm(q.view(T, self.n_heads, self.head_dim)), cos, sin)
        raw_k = k.view(T, self.n_kv, self.head_dim)
        # Under attention_k_eq_v the value is the key projection before k_norm and RoPE.
        v = self.v_norm(raw_k if v is None else v.view(T, self.n_kv, self.head_dim))
        k = apply_rope(self.k_norm(raw_k), cos, sin)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        hd, dtype = self.head_dim, q.dtype
        if self.sliding and T > RING_IN_PLACE_MAX_T:
            # Attend over [ring rows | this call's rows as the ring will hold them], then keep this call's last
            # `ring` rows in the ring.
            keys = torch.cat([read_rows(cache_k, hd, dtype), as_stored(k, cache_k)], dim=1)
            values = torch.cat([read_rows(cache_v, hd, dtype), as_stored(v, cache_v)], dim=1)
            keep = min(T, ring)
            slots = positions[-keep:] % ring
            write_rows(cache_k, slots, k[:, -keep:])
            write_rows(cache_v, slots, v[:, -keep:])
        else:
            # Rows written first and read in place (the ring whole, the full layers' first kv_len rows): a token's
            # keys sit at the same places whether it comes alone or in a verify block, so with decode_attention
            # its output bits are the same (batch invariance), and nothing is copied.
            rows = positions % ring if self.sliding else positions
            write_rows(cache_k, rows, k)
            write_rows(cache_v, rows, v)
            keys, values, mask = self._in_place(cache_k, cache_v, ring, kv_len, mask)
            if T <= self.attention_rows:  # the kernel reads every cache type itself
                return self.o_proj(decode_attention(q.transpose(0, 1), keys, values, mask, scale=1.0))
            keys, values = read_rows(keys, hd, dtype), read_rows(values, hd, dtype)
        # grouped_attention: a boolean mask with grouped heads took SDPA's math kernel, every score in float32
        out = grouped_attention(q.transpose(0, 1)[None], keys[None], values[None], mask, scale=1.0)
        return self.o_proj(out[0].transpose(0, 1).reshape(T, self.n_heads * self.head_dim))

    def _in_place(self, cache_k, cache_v, ring: int, kv_len: int, mask):
        """The cache rows a pass that wrote its own rows first attends over, and its mask cut to them. Every
        position is below kv_len, so a ring longer than kv_len holds rows only below kv_len: the sliding layers of
        a short context read that many."""
        n = min(kv_len, ring) if self.sliding else kv_len
        mask = mask if isinstance(mask, CausalBias) else mask[:, :n]  # a causal bias spans kv_len already
        return cache_k[:, :n], cache_v[:, :n], mask


class Gemma4Router(nn.Module):
    """Expert choice: softmax over all experts of proj(rmsnorm(x) * scale / sqrt(H)), top-k, renormalised to sum 1,
    then times each chosen expert's per_expert_scale. Computed as exp(s - max) of the top-k scores over their own
    sum (the same values: the softmax's denominator cancels), added in order (add_in_order): no reduction over the
    experts or the choices for torch.compile to order by the pass's shape."""

    def __init__(self, cfg: Gemma4Config, plan: LayerPlan):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_weight=False, rows=plan.attention_rows)
        self.proj = Linear(cfg.hidden_size, cfg.num_experts, bias=False, max_rows=plan.gemm_rows)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.root_size = cfg.hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(x) * self.scale * self.root_size).float()
        top, experts = torch.topk(scores, self.top_k, dim=-1)  # largest first
        e = torch.exp(top - top[:, :1])
        return e / add_in_order(e)[:, None] * self.per_expert_scale[experts], experts


class Gemma4Experts(nn.Module):
    """Expert GeGLU MLPs as stacked tensors: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    Passes of up to PAIR_TOKENS tokens (decoding, a speculative verify block) multiply each (token, choice) pair by
    its own gathered expert, so that a token's products are the same whether it comes alone or in a block (greedy
    DFlash must give plain decoding's tokens); longer passes (prefill) run each expert on its tokens."""

    PAIR_TOKENS = 16

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        T, k = experts.shape
        if T <= self.PAIR_TOKENS:
            return self._gathered(x, weights, experts)
        if _capturing():
            return self._all_experts(x, weights, experts)
        out = torch.zeros_like(x)
        # Loop over the experts some token chose; each runs on its tokens only. Listing them syncs with the host,
        # which is cheap next to a long prompt's work but cannot be captured in a CUDA graph.
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each (token, choice) multiplies a gathered copy of its expert's matrices: a pair's product is the same
        whatever else is in the pass. Reads only the chosen experts, and never syncs with the host."""
        T, k = experts.shape
        rows = x[:, None, :, None].expand(T, k, x.shape[-1], 1)
        gate, up = torch.matmul(self.gate_up_proj[experts], rows).squeeze(-1).chunk(2, dim=-1)
        y = torch.matmul(self.down_proj[experts], (F.gelu(gate, approximate="tanh") * up)[..., None]).squeeze(-1)
        return weigh_choices(y, weights).to(x.dtype)

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert on every row, unchosen ones weighted 0: for verify blocks inside a CUDA graph, where
        the choices cover most experts anyway, so each expert's weights are read once and nothing is copied."""
        gate, up = torch.einsum("th,eoh->teo", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("tei,ehi->teh", F.gelu(gate, approximate="tanh") * up, self.down_proj)
        dense = torch.zeros(y.shape[:2], device=x.device, dtype=weights.dtype).scatter(1, experts, weights)
        return (y * dense[..., None]).sum(dim=1).to(x.dtype)


def add_in_order(t: torch.Tensor) -> torch.Tensor:
    """t[:, 0] + t[:, 1] + ... for t [T, k, ...], added in that order. Written as a sum over dim 1, torch.compile
    makes it a reduction whose order it picks from the pass's shape once k reaches its unrolling threshold (8, the
    26B-A4B's top-k): a token's sum then rounded differently alone than in a verify block on the GPU
    (scripts/gpu/expert_pairs_run.py). A chain of additions is the same expression for every pass."""
    out = t[:, 0]
    for c in range(1, t.shape[1]):
        out = out + t[:, c]
    return out


def weigh_choices(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over c of weights[t, c] * y[t, c] for y [T, k, H] and weights [T, k], in order (add_in_order); float32
    for bf16 y and float32 weights."""
    return add_in_order(y * weights[..., None])


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int, plan: LayerPlan):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, layer, plan)
        self.mlp = GatedMLP(h, cfg.intermediate_size, plan=plan, activation="gelu_tanh")

        def norm() -> Gemma4RMSNorm:  # a few-row pass's norms one row kernel each
            return Gemma4RMSNorm(h, eps, rows=plan.attention_rows)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        # A checkpoint value (JAX skip_scale), not 1: it scales the whole residual stream leaving the layer.
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.moe = cfg.num_experts > 0
        # passes of up to this many tokens join each branch to the residual with one kernel a join (the norms
        # around it, the add, the layer scalar, the next layer's input norm), and an MoE layer its two branches:
        # compiled, these were reductions whose code the compiler chose (and autotuned) for the pass's row count
        # (docs/performance.md; gemma4_invariance.py --moe)
        self.norm_rows = plan.attention_rows
        if self.moe:
            self.router = Gemma4Router(cfg, plan)
            self.experts = Gemma4Experts(cfg)
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()

    def forward(self, h, x, next_weight, cos, sin, cache_k, cache_v, ring: int, positions, kv_len: int,
                mask) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the layer's output, the next layer's normed input or None) for the residual h [T, hidden]. x: h's input
        norm where the layer before computed it in its last join (a few-row pass after the first layer), else None;
        next_weight: the weight of the norm after this layer (the next layer's input norm, or the final norm after
        the last layer), which a few-row pass's last join computes in the same kernel (one launch a layer less; the
        same bits as the norm alone). Every norm of a Gemma 4 text model has the config's one eps."""
        if x is None:
            x = self.input_layernorm(h)
        attn = self.self_attn(x, cos, sin, cache_k, cache_v, ring, positions, kv_len, mask)
        if h.shape[0] <= self.norm_rows:
            h, x = gemma_add_norm(attn, h, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight,
                                  self.post_attention_layernorm.eps)
            ff = self.mlp(x)
            if self.moe:
                ff = self._with_experts(h, ff)
            return gemma_add_scaled_norm(ff, h, self.post_feedforward_layernorm.weight, self.layer_scalar,
                                         next_weight, self.post_feedforward_layernorm.eps)
        h = h + self.post_attention_layernorm(attn)
        ff = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            ff = self._with_experts(h, ff)
        h = h + self.post_feedforward_layernorm(ff)
        return h * self.layer_scalar, None

    def _with_experts(self, h: torch.Tensor, ff: torch.Tensor) -> torch.Tensor:
        """The MoE branch joined to the shared MLP's output ff (the dense MLP is the always-on shared expert; the
        router reads the raw residual h): both normed and added, for a few-row pass with one kernel (gemma_add; the
        same bits: the sum of two values commutes)."""
        weights, experts = self.router(h)
        routed = self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(h), weights, experts))
        shared = self.post_feedforward_layernorm_1
        if h.shape[0] <= self.norm_rows:
            return gemma_add(ff, routed, shared.weight, shared.eps)
        return shared(ff) + routed


class Gemma4TextModel(nn.Module):
    def __init__(self, cfg: Gemma4Config, plan: LayerPlan):
        super().__init__()
        # Given an (uninitialised) weight, Embedding skips its random init, which is slow on the meta device.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i, plan) for i in range(cfg.num_hidden_layers))
        # its final norm over few rows (a few-row pass's, or logits_row's one) one row kernel too: eager, one token's
        # logits of 16 differed alone on an H100 where its last hidden state did not
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rows=plan.attention_rows)


class Gemma4LM(nn.Module):
    """The engine's target contract (see DecoderLM) for Gemma 4."""

    def __init__(self, cfg: Gemma4Config, plan: LayerPlan = LayerPlan()):
        super().__init__()
        self.config, self.plan = cfg, plan
        self.model = Gemma4TextModel(cfg, plan)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, max_rows=plan.gemm_rows)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for kind in sorted(set(cfg.layer_types)):
            head_dim = next(cfg.layer_head_dims[i] for i, t in enumerate(cfg.layer_types) if t == kind)
            self.register_buffer(f"{kind}_inv_freq", rope_inverse_frequencies(cfg.rope[kind], head_dim),
                                 persistent=False)

    def prepare(self) -> None:
        """With the plan's fuse_projections (the GPU's), each layer's q/k/v and gate/up as one projection where
        their weights allow (float, or GGUF blocks of one type); otherwise the projections as loaded. Once."""
        if self.plan.fuse_projections:
            for layer in self.model.layers:
                layer.self_attn.fuse_projections()
                layer.mlp.fuse_projections()

    @property
    def embed_scale(self) -> torch.Tensor:
        """sqrt(hidden) in the embedding's dtype, made once per (dtype, device) and cached. Never reads the
        embedding's values: `.weight` of a QuantEmbedding would dequantize the whole table on every call."""
        emb = self.model.embed_tokens
        store = getattr(emb, "blocks", None)  # a QuantEmbedding: blocks hold the data, .dtype the compute dtype
        dtype, device = (emb.dtype, store.device) if store is not None else (emb.weight.dtype, emb.weight.device)
        cached = self.__dict__.get("_embed_scale")
        if cached is None or cached.dtype != dtype or cached.device != device:
            cached = embedding_scale(self.config.hidden_size, dtype, device)
            self.__dict__["_embed_scale"] = cached
        return cached

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens) * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def new_cache(self, capacity: int, k_type: str | None = None, v_type: str | None = None) -> Gemma4Cache:
        """A cache of `capacity` positions; k_type / v_type: KV cache types (None: the compute dtype)."""
        p = self.model.norm.weight  # a float parameter even when the projections are quantized
        return Gemma4Cache(self.config, capacity, p.device, p.dtype, k_type, v_type)

    def _rope(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for kind in set(self.config.layer_types):
            freqs = positions[:, None].float() * getattr(self, f"{kind}_inv_freq")[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            out[kind] = (emb.cos(), emb.sin())
        return out

    def _masks(self, positions: torch.Tensor, cache: Gemma4Cache, kv_len: int,
               causal: bool) -> dict[str, torch.Tensor | CausalBias]:
        """Boolean masks [T, keys] per layer type. kv_len may exceed the last position + 1 (a CUDA graph captured for
        a longer length): full layers hide rows past each query, sliding layers decide by stored positions: over
        the ring as this call leaves it (few rows, Gemma4Attention writes first), or over [ring | this call's
        rows], where ring rows at or after the call's first position are stale. causal (positions kv_len - T ..
        kv_len - 1) and more rows than the few-row paths take: the full layers' mask is causal from the lower
        right, no tensor (DecoderLM.forward)."""
        q = positions[:, None]
        T = positions.shape[0]
        if causal and T > self.plan.max_rows:
            masks = {FULL: causal_lower_right(T, kv_len)}
        else:
            masks = {FULL: torch.arange(kv_len, device=positions.device)[None, :] <= q}
        if SLIDING in self.config.layer_types:
            w = cache.window
            if positions.shape[0] <= RING_IN_PLACE_MAX_T:
                stored = cache.ring_pos.index_copy(0, positions % cache.ring, positions)[None, :]
                masks[SLIDING] = (stored <= q) & (q - stored < w)
            else:
                stored = cache.ring_pos[None, :]
                ring = (stored < positions[:1, None]) & (q - stored < w)
                new = (positions[None, :] <= q) & (q - positions[None, :] < w)
                masks[SLIDING] = torch.cat([ring, new], dim=1)
        return masks

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Gemma4Cache, kv_len: int,
                tap_ids: list[int] | None = None, logits_row: torch.Tensor | None = None, causal: bool = False):
        """tokens [T] at ascending contiguous positions [T], reading full-layer cache rows below kv_len (at least the
        last position + 1); see DecoderLM.forward (causal: for the full layers).

        Returns float32 softcapped logits and, with tap_ids, the outputs of those layers (after layer_scalar)
        concatenated in list order.
        """
        T = positions.shape[0]
        rope, masks = self._rope(positions), self._masks(positions, cache, kv_len, causal)
        h = self.embed(tokens)
        taps, wanted = {}, set(tap_ids or ())
        layers = self.model.layers
        # the norm after each layer: in a few-row pass the layer's last join applies it (x), the last one's for the
        # head
        after = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        x = None
        for i, layer in enumerate(layers):
            kind = self.config.layer_types[i]
            h, x = layer(h, x, after[i].weight, *rope[kind], cache.k[i], cache.v[i], cache.ring, positions, kv_len,
                         masks[kind])
            if i in wanted:
                taps[i] = h
        if SLIDING in self.config.layer_types:
            keep = min(T, cache.ring)
            cache.ring_pos.index_copy_(0, positions[-keep:] % cache.ring, positions[-keep:])
        # logits_row: a [1] index on the device (a graphed pass's varies from replay to replay); the final norm of a
        # longer pass's row is a one-row pass's (the row kernel's) too
        if x is not None:
            normed = x if logits_row is None else x.index_select(0, logits_row)
        else:
            normed = self.model.norm(h if logits_row is None else h.index_select(0, logits_row))
        logits = self.logits(normed)
        return logits, (torch.cat([taps[i] for i in tap_ids], dim=-1) if tap_ids else None)


def _text_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The text decoder's tensors under our names (model.*, lm_head.*); vision/audio towers are skipped unread."""
    files = safetensors_files(folder)
    names = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update({n: f for n in st.keys()})
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
    wanted = {n: "model." + n[len(prefix):] for n in names if n.startswith(prefix)}
    if "lm_head.weight" in names:
        wanted["lm_head.weight"] = "lm_head.weight"
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for n in st.keys():
                if n in wanted:
                    tensors[wanted[n]] = st.get_tensor(n)
    return tensors


def load_gemma4_target(folder: Path, device=None, dtype=None, plan: LayerPlan = LayerPlan()) -> Gemma4LM:
    """A Gemma 4 checkpoint folder (Gemma4ForConditionalGeneration or Gemma4ForCausalLM layout) as a Gemma4LM."""
    folder = Path(folder)
    cfg = Gemma4Config.from_folder(folder)
    device, dtype = default_device_dtype(device, dtype)
    with torch.device("meta"):
        model = Gemma4LM(cfg, plan)
    tensors = _text_tensors(folder)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        raise CheckpointError(f"{folder}: tie_word_embeddings is false but there is no 'lm_head.weight'")
    assign_tensors(model, tensors, folder, device, dtype)
    if cfg.tie_word_embeddings:  # loading by assignment replaced the shared Parameter on one side only
        model.lm_head.weight = model.model.embed_tokens.weight
    for kind in sorted(set(cfg.layer_types)):
        name = f"{kind}_inv_freq"
        setattr(model, name, getattr(model, name).to(device))
    return model.eval().requires_grad_(False)


def gemma4_max_positions(folder: Path) -> int:
    path = Path(folder) / "config.json"
    return Gemma4Config.from_dict(read_json(path), str(path)).max_position_embeddings
