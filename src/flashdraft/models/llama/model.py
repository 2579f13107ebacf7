"""Decoder-only language model over a static KV cache: the Qwen3 and Llama-3.x targets, their block
(DecoderLayer), and the DFlash drafter, whose layers are that block too.

Module and parameter names follow HF (model.embed_tokens, model.layers.N..., model.norm, lm_head), so a
checkpoint's state dict loads as is. Qwen3 differs from Llama only in per-head q/k RMSNorm (ModelConfig.qk_norm)
and its explicit head_dim; both come from config.json, so one class serves both families.

The DFlash drafter (DFlashDrafter) is a few non-causal decoder layers fed with target hidden states as injected
keys/values; parameter names follow z-lab's checkpoints (fc, hidden_norm, norm, layers.N...). It has no embedding
and no LM head: the target's embed the block and turn its outputs into logits.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from flashdraft.config import DrafterConfig, ModelConfig
from flashdraft.layers import decode_attention, qkv_prep
from flashdraft.layers.attention import Attention, AttentionSegment, MergedSegments, merge_segments, segment_table
from flashdraft.layers.elementwise import RMSNorm, RotaryEmbedding
from flashdraft.layers.plan import LayerPlan
from flashdraft.layers.rms_norm_rows import rms_norm_rows
from flashdraft.layers.skinny_gemm import Linear, attach_fused, fold_norm_weight, skinny_linear
from flashdraft.layers.swiglu_rows import swiglu_rows
from flashdraft.models.kv_cache import KVCache, WindowKVCache
from flashdraft.quant.kv_formats import write_rows
from flashdraft.quant.linear import QuantLinear


class GatedMLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act SiLU (SwiGLU: Llama, Qwen3, the drafter) or GELU's tanh
    approximation (GeGLU: Gemma 4), given at construction."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, plan: LayerPlan = LayerPlan(),
                 activation: str = "silu"):
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"GatedMLP: activation {activation!r} (supported: silu, gelu_tanh)")
        self.gelu_tanh = activation == "gelu_tanh"
        self.gate_proj = Linear(hidden, intermediate, bias=bias, max_rows=plan.gemm_rows)
        self.up_proj = Linear(hidden, intermediate, bias=bias, max_rows=plan.gemm_rows)
        self.down_proj = Linear(intermediate, hidden, bias=bias, max_rows=plan.gemm_rows)
        self.gate_up_proj = None  # gate and up as one projection, once fuse_projections() found them alike

    def fuse_projections(self) -> None:
        """gate and up as one projection (fuse_rows: float, or GGUF blocks of one type): one GEMM per step instead
        of two; their weights become views of its own, so no memory is added. Done once."""
        if self.gate_up_proj is None:
            attach_fused(self, "gate_up_proj", [self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu_tanh else F.silu(gate)) * up)

    def rows_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + forward(x) for a few-row pass x [T, hidden] of GGUF projections (DecoderLayer.quant_forward):
        SwiGLU as one kernel where gate and up are fused (swiglu_rows, with the eager ops' roundings), and the
        residual added as down_proj's kernel stores its product where it takes one (QuantLinear, the bits of the
        add): two launches a layer less."""
        if self.gate_up_proj is None or self.gelu_tanh:
            return residual + self(x)
        act = swiglu_rows(self.gate_up_proj(x))
        if isinstance(self.down_proj, QuantLinear):
            return self.down_proj(act, residual=residual)
        return residual + self.down_proj(act)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block shared by Qwen3, Llama and the DFlash drafter (parameter names as in HF).

    Its plan fixes the kernels of few-row passes; prepare() lays the weights out for them once they are loaded,
    and with the plan's fused path (both Triton backends) such passes then run as fused_forward."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan = LayerPlan(), context_projection: bool = False):
        super().__init__()
        self.plan = plan
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, plan, context_projection)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, plan)
        self.fused_rows = 0  # > 0 once prepared for a fused path: passes of up to this many tokens take it
        self.norms_folded = False  # that path is fused_forward (float weights, norms folded in), else quant_forward
        self._compiled_module_path = None  # compile_module_path(): DecoderLayer.module_forward compiled

    def forward(self, h, cos, sin, cache_k, cache_v, positions, kv_len: int, mask: torch.Tensor | None):
        if h.shape[0] <= self.fused_rows:
            return self._few_rows_path(h, cos, sin, [AttentionSegment(h.shape[0], cache_k, cache_v, positions, kv_len,
                                                                      mask)])
        if self._compiled_module_path is not None:
            return self._compiled_module_path(self, h, cos, sin, cache_k, cache_v, positions, kv_len, mask)
        return self.module_forward(h, cos, sin, cache_k, cache_v, positions, kv_len, mask)

    def _few_rows_path(self, h, cos, sin, segments: list[AttentionSegment], merged: MergedSegments | None = None):
        return (self.fused_forward if self.norms_folded else self.quant_forward)(h, cos, sin, segments, merged)

    def compile_module_path(self) -> None:
        """torch.compile the module path alone, for a layer on a fused path: its passes of more rows than that path
        takes (prefill) get their elementwise ops fused as a compiled layer's are (eager, they are slower:
        docs/performance.md), while the few-row passes keep their batch-invariant kernels. Invariance does not
        matter past those rows: plain decoding and DFlash run a prompt through the same passes. Done once. (The
        function, not this layer's bound method, is compiled: the layer holds no reference to itself.)"""
        if self._compiled_module_path is None:
            self._compiled_module_path = torch.compile(DecoderLayer.module_forward, dynamic=True)

    def module_forward(self, h, cos, sin, cache_k, cache_v, positions, kv_len: int, mask: torch.Tensor | None):
        """The block module by module: every pass on the module path, and longer ones (prefill) on the fused."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache_k, cache_v, positions, kv_len, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def segments_forward(self, h, cos, sin, segments: list[AttentionSegment], merged: MergedSegments | None = None):
        """The block over several sequences' rows at once (a batched step), each sequence's attention over its own
        cache, the rest over all rows: the fused (or quantized) path where all rows fit it (merged: the segments'
        attention as one launch of each kernel, Attention._prepped_attention), else module by module."""
        if h.shape[0] <= self.fused_rows:
            return self._few_rows_path(h, cos, sin, segments, merged)
        h = h + self.self_attn.segments_forward(self.input_layernorm(h), cos, sin, segments)
        return h + self.mlp(self.post_attention_layernorm(h))

    def fused_forward(self, h, cos, sin, segments: list[AttentionSegment], merged: MergedSegments | None = None):
        """The same block in four GEMMs and, per segment (a sequence's rows and cache), qkv_prep and attention (one
        launch of each for all segments, given merged).
        Each RMSNorm runs in the GEMM that reads its output (its weight folded into that GEMM's weight: prepare),
        each residual add in the epilogue of the GEMM that produces it, SwiGLU in the gate/up GEMM's epilogue,
        and q/k norm, RoPE and the cache writes in one kernel (layers.qkv_prep). At batch 1 the elementwise
        kernels and the gaps between launches cost a sixth of a step otherwise."""
        mlp = self.mlp
        h = self.self_attn.fused_forward(h, self.input_layernorm.eps, cos, sin, segments, merged)
        act = skinny_linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                            rms_norm_eps=self.post_attention_layernorm.eps, gated=True)
        return skinny_linear(act, mlp.down_proj.weight, mlp.down_proj.bias, residual=h)

    def quant_forward(self, h, cos, sin, segments: list[AttentionSegment], merged: MergedSegments | None = None):
        """The same block for projections held as GGUF blocks, whose kernels cannot take a norm or an epilogue:
        the quantized products, each RMSNorm one kernel (the second with the residual add before it), q/k norm,
        RoPE and the cache writes one kernel (qkv_prep), attention, SwiGLU one kernel and the last residual add in
        down_proj's product (GatedMLP.rows_forward). Every kernel computes a row from that row alone, so a token's
        bits are the same in a verify block as alone, which the compiled module path did not give (rms_norm_rows)."""
        h, x = rms_norm_rows(h, self.input_layernorm.weight, self.input_layernorm.eps)
        attn = self.self_attn.prepped_forward(x, cos, sin, segments, merged)
        h, x = rms_norm_rows(h, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps, attn)
        return self.mlp.rows_forward(x, h)

    @torch.no_grad()
    def prepare(self) -> None:
        """Lay the loaded weights out for the plan, once: fused q/k/v and gate/up projections (plan
        fuse_projections: float ones, or GGUF blocks of one type), and for the fused path (float weights), where
        the weights and head size allow it, the two RMSNorms' weights folded into them (W[:, k] *= g[k], the
        norms' weights made ones: the same model on every path, and the fused GEMMs feed x to the tensor cores as
        loaded). Keys and values that a drafter projects from context rows without the input norm keep unfolded
        k/v weights of their own."""
        attn, mlp = self.self_attn, self.mlp
        if self.fused_rows or not self.plan.fuse_projections:
            return
        attn.fuse_projections()
        mlp.fuse_projections()
        if not (self.plan.fused and decode_attention.supports(attn.head_dim) and attn.head_dim in qkv_prep.HEAD_DIMS):
            return
        # fused_forward reads the float weights of the fused projections, o_proj and down_proj; other
        # projections (GGUF blocks) take quant_forward, with the norms as they are
        floats = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(p) is Linear for p in floats):
            self.fused_rows = self.plan.max_rows
            return
        if attn.context_projection:
            attn.k_proj.weight = nn.Parameter(attn.k_proj.weight.clone(), requires_grad=False)
            attn.v_proj.weight = nn.Parameter(attn.v_proj.weight.clone(), requires_grad=False)
        for norm, weight in ((self.input_layernorm, attn.qkv_proj.weight),
                             (self.post_attention_layernorm, mlp.gate_up_proj.weight)):
            fold_norm_weight(weight, norm.weight)
            norm.weight.fill_(1.0)
        self.fused_rows, self.norms_folded = self.plan.max_rows, True


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
        return self._run_layers(tokens, tap_ids, logits_row, lambda layer, i, h: layer(
            h, cos, sin, cache.k[i], cache.v[i], positions, kv_len, mask))

    def forward_segments(self, tokens: torch.Tensor, positions: torch.Tensor,
                         segments: list[tuple[int, KVCache, int]], tap_ids: list[int] | None = None,
                         table: torch.Tensor | None = None):
        """forward for several sequences' rows in one pass (a batched step of their decoding): tokens [R] and
        positions [R] hold each segment's rows in turn, a segment being (rows, its sequence's cache, kv_len), each
        row causal by absolute position over its own cache's first kv_len rows. Returns forward's outputs for all R
        rows. The layers take their few-row path where all R rows fit it (each row's bits its own, as alone; each
        attention kernel one launch for all segments where their caches allow: table, segment_table(segments),
        made here when not given; a CUDA graph keeps it as a constant made outside capture), else the module path;
        the final norm runs per segment, so that a row gets the bits its sequence's pass alone gives it (a
        reduction kernel's tiling may follow the row count)."""
        cos, sin = self.rope(positions)
        parts, at = [], 0
        for rows, cache, kv_len in segments:
            p = positions[at:at + rows]
            parts.append((rows, cache, p, kv_len, torch.arange(kv_len, device=p.device)[None, :] <= p[:, None]))
            at += rows
        merged = _merged(self.model.layers, tokens.shape[0], [(AttentionSegment(rows, cache.k[0], cache.v[0], p, kv_len,
                                                                                mask), cache)
                                                               for rows, cache, p, kv_len, mask in parts], table)
        return self._run_layers(tokens, tap_ids, None, lambda layer, i, h: layer.segments_forward(
            h, cos, sin, [AttentionSegment(rows, cache.k[i], cache.v[i], p, kv_len, mask)
                          for rows, cache, p, kv_len, mask in parts], merged), [rows for rows, *_ in segments])

    def segment_table(self, segments: list[tuple[int, KVCache, int]]) -> torch.Tensor | None:
        """The segment table of forward_segments' segments (None where one launch cannot serve their caches)."""
        return _segment_table([rows for rows, _, _ in segments], [cache for _, cache, _ in segments])

    def _run_layers(self, tokens: torch.Tensor, tap_ids: list[int] | None, logits_row: torch.Tensor | None, layer_pass,
                    segment_rows: list[int] | None = None):
        """Embed tokens, run each decoder layer as layer_pass(layer, index, h) says, and return the logits and taps
        (forward's outputs); segment_rows: the final norm over each segment's rows apart."""
        h = self.embed(tokens)
        taps = {}
        wanted = set(tap_ids or ())
        for i, layer in enumerate(self.model.layers):
            h = layer_pass(layer, i, h)
            if i in wanted:
                taps[i] = h
        if logits_row is not None:  # a [1] index on the device: a graphed pass's varies from replay to replay
            h = h.index_select(0, logits_row)
        logits = self.logits(_final_norm(self.model.norm, h, self.model.layers, segment_rows))
        tap_out = torch.cat([taps[i] for i in tap_ids], dim=-1) if tap_ids else None
        return logits, tap_out


def _final_norm(norm: RMSNorm, h: torch.Tensor, layers, segment_rows: list[int] | None = None) -> torch.Tensor:
    """norm(h): one kernel that computes a row from that row alone (rms_norm_rows) where the layers take their
    few-row path for h's rows, so a token's bits are the same in a verify block as alone, in one launch instead of
    the module's seven; else the module, over each segment's rows apart where segment_rows is given (more than
    one: a reduction kernel's tiling may follow the row count)."""
    if h.shape[0] <= min(layer.fused_rows for layer in layers):
        return rms_norm_rows(h, norm.weight, norm.eps)[1]
    if segment_rows is None or len(segment_rows) == 1:
        return norm(h)
    return torch.cat([norm(part) for part in h.split(segment_rows)])


def _segment_table(rows: list[int], caches: list[KVCache]) -> torch.Tensor | None:
    return segment_table(rows, [cache.k for cache in caches], [cache.v for cache in caches])


def _merged(layers, rows: int, segments: list[tuple[AttentionSegment, KVCache]],
            table: torch.Tensor | None) -> MergedSegments | None:
    """The pass's MergedSegments (from its segments' first layer, and their caches), where its layers take their
    few-row path for `rows` rows and there are several segments whose caches one launch serves; else None."""
    if len(segments) < 2 or rows > min(layer.fused_rows for layer in layers):
        return None
    if table is None:
        table = _segment_table([s.rows for s, _ in segments], [cache for _, cache in segments])
    return None if table is None else merge_segments([s for s, _ in segments], table)


def _kv_rows(attn: Attention) -> QuantLinear | None:
    """The [k; v] rows of an attention's fused q/k/v GGUF blocks as a projection of its own (a view: no memory
    added), or None where q, k and v are not one QuantLinear."""
    fused = attn.qkv_proj
    if type(fused) is not QuantLinear:
        return None
    return QuantLinear(fused.blocks[attn.q_proj.out_features:], fused.qtype, fused.in_features, fused.dtype)


def _in_window(taps: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Context rows a drafter cache keeps: of a ring, at most its length (rows a ring's length apart would share a
    row in one write; the older ones are out of the window)."""
    if isinstance(cache, WindowKVCache) and taps.shape[0] > cache.capacity:
        return taps[-cache.capacity:], positions[-cache.capacity:]
    return taps, positions


def _block_rows(cache: KVCache, positions: torch.Tensor, kv_len: int,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where a drafter block at these positions goes in its cache (noted there), and its mask: a window cache
    hides its stale rows itself."""
    cache.record(positions)
    if isinstance(cache, WindowKVCache):
        visible = cache.visible(kv_len, positions[-1])
        mask = visible if mask is None else mask & visible
    return cache.rows(positions), mask


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
        # bias; on the quantized path (GGUF layers), per layer, the [k; v] rows of its fused q/k/v blocks as one
        # product; add_context calls of up to context_fused_rows rows take them
        self.context_kv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.context_kv_blocks: list[QuantLinear] = []
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
        taps, positions = _in_window(taps, positions, cache)
        cache.record(positions)
        if 0 < taps.shape[0] <= self.context_fused_rows:
            return self._add_context_fused([(taps, positions, cache)])
        self._write_context([(taps, positions, cache)])

    def add_context_segments(self, parts: list[tuple[torch.Tensor, torch.Tensor, KVCache]]) -> None:
        """add_context for several sequences at once, (taps, positions, cache) each (a batched step's): fc,
        hidden_norm and each layer's key/value projection over all their rows, each sequence's rows written to its
        own cache; the fused path where all rows fit it."""
        parts = [(*_in_window(taps, positions, cache), cache) for taps, positions, cache in parts]
        for _, positions, cache in parts:
            cache.record(positions)
        if 0 < sum(taps.shape[0] for taps, _, _ in parts) <= self.context_fused_rows:
            return self._add_context_fused(parts)
        self._write_context(parts)

    def _write_context(self, parts: list[tuple[torch.Tensor, torch.Tensor, KVCache]]) -> None:
        ctx = self.hidden_norm(self.fc(torch.cat([taps for taps, _, _ in parts])))
        cos, sin = self.rope(torch.cat([positions for _, positions, _ in parts]))
        rows = [cache.rows(positions) for _, positions, cache in parts]
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            at = 0
            for (taps, _, cache), cache_rows in zip(parts, rows):
                n = taps.shape[0]
                write_rows(cache.k[i], cache_rows, k[:, at:at + n])
                write_rows(cache.v[i], cache_rows, v[:, at:at + n])
                at += n

    @torch.no_grad()
    def prepare(self) -> None:
        """Lay the loaded weights out for the plan (DecoderLayer.prepare), once. Where every layer takes the fused
        path, add_context calls of up to max_rows rows (a step's accepted tokens) go through two kernels per layer:
        a skinny GEMM of the fc output with the [k; v] weights, hidden_norm in it (its weight folded into theirs),
        and qkv_prep with no query heads (k_norm, RoPE, both cache writes). Where every layer takes quant_forward
        with q/k/v as one product (GGUF blocks of one type), the same two a layer after hidden_norm as one kernel:
        the product of the [k; v] rows of its blocks (a view), and qkv_prep. The module path costs about 15 small
        kernels per layer there, most of the extra kernel time of a DFlash step over its two passes on an H200
        (docs/performance.md)."""
        for layer in self.layers:
            layer.prepare()
        if self.context_fused_rows:
            return
        if all(layer.fused_rows and not layer.norms_folded for layer in self.layers):
            projections = [_kv_rows(layer.self_attn) for layer in self.layers]
            if all(p is not None for p in projections):
                self.context_kv_blocks = projections
                self.context_fused_rows = self.plan.max_rows
            return
        if not all(layer.norms_folded for layer in self.layers):
            return
        for layer in self.layers:
            attn = layer.self_attn
            weight = torch.cat([attn.k_proj.weight, attn.v_proj.weight])
            fold_norm_weight(weight, self.hidden_norm.weight)
            bias = torch.cat([attn.k_proj.bias, attn.v_proj.bias]) if attn.k_proj.bias is not None else None
            self.context_kv.append((weight, bias))
        self.context_fused_rows = self.plan.max_rows

    def _add_context_fused(self, parts: list[tuple[torch.Tensor, torch.Tensor, KVCache]]) -> None:
        """The fused context projection of (taps, positions, cache) parts: fc and each layer's [k; v] GEMM (or
        quantized product, after hidden_norm) over all their rows, each part's keys and values into its own cache
        (qkv_prep)."""
        taps = parts[0][0] if len(parts) == 1 else torch.cat([taps for taps, _, _ in parts])
        fc_out = self.fc(taps)
        if self.context_kv_blocks:
            _, ctx = rms_norm_rows(fc_out, self.hidden_norm.weight, self.hidden_norm.eps)
            kvs = (project(ctx) for project in self.context_kv_blocks)
        else:
            kvs = (skinny_linear(fc_out, weight, bias, rms_norm_eps=self.hidden_norm.eps)
                   for weight, bias in self.context_kv)
        cos, sin = self.rope(parts[0][1] if len(parts) == 1 else torch.cat([p for _, p, _ in parts]))
        cache_rows = [cache.rows(positions) for _, positions, cache in parts]
        for i, (layer, kv) in enumerate(zip(self.layers, kvs)):
            at = 0
            for (part_taps, _, cache), rows in zip(parts, cache_rows):
                span = slice(at, at + part_taps.shape[0])
                layer.self_attn.write_context_kv(kv[span], cos[span], sin[span], rows, cache.k[i], cache.v[i])
                at = span.stop

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Block embeddings [B, hidden] at positions start..start+B-1 -> normed hidden states [B, hidden].

        kv_len = cache.kv_len(start + B). The block attends to all cached context (positions < start) and to
        itself, bidirectionally, so no mask is needed. Its own keys land in the cache at the block positions and
        are overwritten by context rows later. A caller reading more rows (a graph captured for a longer
        kv_len) passes a mask hiding the rows past the block; a window cache masks its stale rows itself.
        """
        cos, sin = self.rope(positions)
        rows, mask = _block_rows(cache, positions, kv_len, mask)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.k[i], cache.v[i], rows, kv_len, mask)
        return _final_norm(self.norm, h, self.layers)

    def forward_segments(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                         segments: list[tuple[KVCache, int, torch.Tensor | None]],
                         table: torch.Tensor | None = None) -> torch.Tensor:
        """forward for several sequences' blocks in one pass (a batched step's): block_embeds and positions hold the
        blocks in turn, each block (B rows) over its own (cache, kv_len, mask: as forward's); the layers' few-row
        path where all blocks fit it (table: as DecoderLM.forward_segments'), the final norm per block."""
        B = self.block_size
        cos, sin = self.rope(positions)
        parts = [(cache, *_block_rows(cache, positions[j * B:(j + 1) * B], kv_len, mask), kv_len)
                 for j, (cache, kv_len, mask) in enumerate(segments)]
        merged = _merged(self.layers, block_embeds.shape[0], [(AttentionSegment(B, cache.k[0], cache.v[0], rows,
                                                                                kv_len, mask), cache)
                                                              for cache, rows, mask, kv_len in parts], table)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer.segments_forward(h, cos, sin, [AttentionSegment(B, cache.k[i], cache.v[i], rows, kv_len, mask)
                                                     for cache, rows, mask, kv_len in parts], merged)
        return _final_norm(self.norm, h, self.layers, [B] * len(segments))

    def segment_table(self, segments: list[tuple[KVCache, int, torch.Tensor | None]]) -> torch.Tensor | None:
        """The segment table of forward_segments' segments (None where one launch cannot serve their caches)."""
        return _segment_table([self.block_size] * len(segments), [cache for cache, _, _ in segments])

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
