"""Gemma 4 from llama.cpp GGUF files: `gemma4` targets (31B dense, 26B-A4B MoE) and DFlash drafters for them.

The layout is that of llama.cpp's converter (conversion/gemma.py, Gemma4Model) and loader (src/models/gemma4.cpp):

- Per-layer shapes: `attention.sliding_window_pattern` (one bool per layer, true = sliding) chooses the layer
  type; `attention.head_count_kv` is per layer; `attention.key_length` is the full layers' head_dim and
  `attention.key_length_swa` the sliding layers'.
- RoPE: sliding layers rotate the whole head with `rope.freq_base_swa` (llama.cpp falls back to `rope.freq_base`);
  full layers use `rope.freq_base` over the whole head, and `rope_freqs.weight` holds per-pair divisors: 1 for the
  rotated pairs and 1e30 (no rotation) for the rest, which is HF's "proportional" partial RoPE.
- Full layers without `attn_v` take the value from the raw key projection (attention_k_eq_v).
- Norms are stored as they are (no Gemma 1-3 `+1`); `layer_output_scale` is the layer scalar (1 when absent, as
  in llama.cpp); the head is tied to `token_embd` unless there is an `output` tensor.
- MoE: `ffn_gate_inp` (router proj, `.scale` = router scale), `ffn_gate_up_exps` (or `ffn_gate_exps` +
  `ffn_up_exps`), `ffn_down_exps` (`.scale` = per-expert scale), `pre_ffw_norm_2`, `post_ffw_norm_1/2`. Quantized
  experts stay in their blocks: on a GPU, decoding and verify passes multiply each token's chosen experts' blocks
  directly (QuantGemma4Experts' pair products); elsewhere only the experts a token chose are dequantized.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.config import ConfigError
from flashdraft.kernels.runtime import interpreting
from flashdraft.models.gemma4.config import FULL, SLIDING, STOP_TOKENS, Gemma4Config, Gemma4DrafterConfig, RopeSpec
from flashdraft.layers.plan import LayerPlan
from flashdraft.loading.checkpoint import CheckpointError
from flashdraft.loading.gguf import FLOAT_TYPES, GGUFFile, eos_ids, f32, single_value
from flashdraft.models.gemma4.model import Gemma4Experts, Gemma4LM, rope_inverse_frequencies, weigh_choices
from flashdraft.models.gemma4.drafter import Gemma4DFlashDrafter
from flashdraft.models.gguf import GEMMA4_ARCH, TensorInstaller, gguf_drafter_config, install_drafter, tie_lm_head
from flashdraft.quant import UnsupportedQuantType, block_format, dequantize, q6k_lanes
from flashdraft.quant.expert_kernels import PAIR_TYPES, expert_matmul, pair_products_run_on, reads

__all__ = ["GEMMA4_ARCH", "QuantGemma4Experts", "gemma4_gguf_config", "gemma4_gguf_drafter_config",
           "load_gemma4_gguf_drafter", "load_gemma4_gguf_target"]

# rope_freqs.weight divisors at or above this leave a pair unrotated (llama.cpp's converter writes 1e30).
UNROTATED_FACTOR = 1e20

# blk.N.<name> -> (module under model.layers.N, attribute). Biases come before weights: a quantized weight's
# QuantLinear takes the bias already loaded.
_ATTN_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj"}
_LAYER_TENSORS = {
    "attn_norm.weight": ("input_layernorm", "weight"),
    "attn_q_norm.weight": ("self_attn.q_norm", "weight"),
    "attn_k_norm.weight": ("self_attn.k_norm", "weight"),
    "post_attention_norm.weight": ("post_attention_layernorm", "weight"),
    "ffn_norm.weight": ("pre_feedforward_layernorm", "weight"),
    "post_ffw_norm.weight": ("post_feedforward_layernorm", "weight"),
    "ffn_gate.weight": ("mlp.gate_proj", "weight"),
    "ffn_up.weight": ("mlp.up_proj", "weight"),
    "ffn_down.weight": ("mlp.down_proj", "weight"),
}
_MOE_TENSORS = {
    "ffn_gate_inp.weight": ("router.proj", "weight"),
    "ffn_gate_inp.scale": ("router", "scale"),
    "ffn_down_exps.scale": ("router", "per_expert_scale"),
    "pre_ffw_norm_2.weight": ("pre_feedforward_layernorm_2", "weight"),
    "post_ffw_norm_1.weight": ("post_feedforward_layernorm_1", "weight"),
    "post_ffw_norm_2.weight": ("post_feedforward_layernorm_2", "weight"),
}


# --- config ---

def sliding_pattern(g: GGUFFile, n_layers: int, required: bool) -> list[str] | None:
    """Layer types from {arch}.attention.sliding_window_pattern: one bool per layer (true = sliding), or one
    value for every layer (llama.cpp's get_key_or_arr)."""
    key = "attention.sliding_window_pattern"
    pattern = g.arch_get(key)
    if pattern is None:
        if required:
            raise ConfigError(f"{g.path}: missing metadata {g.arch}.{key} (which layers use the sliding window)")
        return None
    if not isinstance(pattern, list):
        pattern = [pattern] * n_layers
    if len(pattern) != n_layers:
        raise ConfigError(f"{g.path}: {g.arch}.{key} has {len(pattern)} entries for {n_layers} layers")
    return [SLIDING if bool(p) else FULL for p in pattern]


def _per_layer(value, n: int, key: str, g: GGUFFile) -> list[int]:
    if isinstance(value, list):
        if len(value) != n:
            raise ConfigError(f"{g.path}: {g.arch}.{key} has {len(value)} entries for {n} layers")
        return [int(v) for v in value]
    return [int(value)] * n


def _reject_unsupported(g: GGUFFile) -> None:
    if int(g.arch_get("embedding_length_per_layer_input", 0) or 0) or "per_layer_token_embd.weight" in g.tensors:
        raise ConfigError(f"{g.path}: per-layer input embeddings ({g.arch}.embedding_length_per_layer_input, "
                          "Gemma 4 E2B/E4B) are not supported; the 31B and 26B-A4B layouts are")
    if int(g.arch_get("attention.shared_kv_layers", 0) or 0):
        raise ConfigError(f"{g.path}: KV-shared layers ({g.arch}.attention.shared_kv_layers, Gemma 4 E2B/E4B) "
                          "are not supported")
    ff = g.arch_get("feed_forward_length")
    if isinstance(ff, list) and len(set(ff)) > 1:
        raise ConfigError(f"{g.path}: per-layer {g.arch}.feed_forward_length {sorted(set(ff))} (double-wide MLP "
                          "layers, Gemma 4 E2B/E4B) is not supported")
    scaling = g.arch_get("rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError(f"{g.path}: rope scaling type {scaling!r} is not supported for Gemma 4")
    if float(g.arch_get("attn_logit_softcapping", 0.0) or 0.0):
        raise ConfigError(f"{g.path}: attention logit softcapping ({g.arch}.attn_logit_softcapping) is not part of "
                          "Gemma 4 and is not supported")


def _full_rope(g: GGUFFile, theta: float, head_dim: int) -> RopeSpec:
    """Full layers: plain RoPE, or proportional partial RoPE when rope_freqs.weight leaves the tail unrotated."""
    if "rope_freqs.weight" not in g.tensors:
        return RopeSpec("default", theta)
    factors = g.raw("rope_freqs.weight").float().flatten()
    if factors.numel() != head_dim // 2:
        raise CheckpointError(f"{g.path}: rope_freqs.weight has {factors.numel()} values, expected "
                              f"key_length/2 = {head_dim // 2}")
    rotated = int((factors < UNROTATED_FACTOR).sum())
    scale = f32(factors[0].item())
    if rotated == 0 or not bool((factors[:rotated] == scale).all()) or not bool(
            (factors[rotated:] >= UNROTATED_FACTOR).all()):
        raise ConfigError(f"{g.path}: rope_freqs.weight {factors.tolist()[:8]}... is not a Gemma 4 partial RoPE "
                          f"(one divisor for the first pairs, >= {UNROTATED_FACTOR:g} for the unrotated rest)")
    spec = RopeSpec("proportional", theta, partial_rotary_factor=rotated / (head_dim // 2), factor=scale)
    if int((rope_inverse_frequencies(spec, head_dim) > 0).sum()) != rotated:
        raise ConfigError(f"{g.path}: cannot express {rotated} rotated pairs of {head_dim // 2} as a partial RoPE")
    return spec


def _rope_specs(g: GGUFFile, layer_types: list[str], full_dim: int, swa_dim: int) -> dict[str, RopeSpec]:
    theta = f32(g.arch_get("rope.freq_base", 10000.0))
    specs = {}
    if FULL in layer_types:
        n_rot = int(g.arch_get("rope.dimension_count", full_dim))
        if n_rot != full_dim:
            raise ConfigError(f"{g.path}: {g.arch}.rope.dimension_count {n_rot} != key_length {full_dim}: Gemma 4 "
                              "full layers rotate over the whole head (partial RoPE comes as rope_freqs.weight)")
        specs[FULL] = _full_rope(g, theta, full_dim)
    if SLIDING in layer_types:
        n_rot = int(g.arch_get("rope.dimension_count_swa", swa_dim))
        if n_rot != swa_dim:
            raise ConfigError(f"{g.path}: partial RoPE on sliding layers ({g.arch}.rope.dimension_count_swa "
                              f"{n_rot} != key_length_swa {swa_dim}) is not supported")
        specs[SLIDING] = RopeSpec("default", f32(g.arch_get("rope.freq_base_swa", theta)))
    return specs


def _k_eq_v(g: GGUFFile, layer_types: list[str]) -> bool:
    """attention_k_eq_v: full layers have no attn_v. Sliding layers always have one."""
    has_v = [f"blk.{i}.attn_v.weight" in g.tensors for i in range(len(layer_types))]
    no_v_sliding = [i for i, t in enumerate(layer_types) if t == SLIDING and not has_v[i]]
    if no_v_sliding:
        raise CheckpointError(f"{g.path}: missing tensor 'blk.{no_v_sliding[0]}.attn_v.weight' (sliding layers "
                              "have their own value projection)")
    full = {has_v[i] for i, t in enumerate(layer_types) if t == FULL}
    if len(full) > 1:
        raise ConfigError(f"{g.path}: some full-attention layers have attn_v and others not; Gemma 4 shares the "
                          "key as value (attention_k_eq_v) on all full layers or on none")
    return full == {False}


def _stop_ids(g: GGUFFile) -> list[int]:
    """EOS/EOT/EOM ids, plus Gemma's turn-ending tokens found by content (as models.gemma4.config.stop_token_ids)."""
    tokens = g.get("tokenizer.ggml.tokens") or []
    index = {t: i for i, t in enumerate(tokens) if t in STOP_TOKENS}
    return list(dict.fromkeys(eos_ids(g) + [index[s] for s in STOP_TOKENS if s in index]))


def gemma4_gguf_config(g: GGUFFile) -> Gemma4Config:
    _reject_unsupported(g)
    if "token_embd.weight" not in g.tensors:
        raise CheckpointError(f"{g.path}: missing tensor 'token_embd.weight'")
    n = int(g.require("block_count"))
    heads = int(single_value(g.require("attention.head_count"), "attention.head_count", g.path))
    layer_types = sliding_pattern(g, n, required=True)
    kv_heads = _per_layer(g.arch_get("attention.head_count_kv", heads), n, "attention.head_count_kv", g)
    full_dim = int(g.require("attention.key_length"))
    swa_dim = int(g.arch_get("attention.key_length_swa", full_dim))
    for k_key, v_key in (("attention.key_length", "attention.value_length"),
                         ("attention.key_length_swa", "attention.value_length_swa")):
        k, v = g.arch_get(k_key), g.arch_get(v_key)
        if k is not None and v is not None and int(k) != int(v):
            raise ConfigError(f"{g.path}: {g.arch}.{v_key} {v} != {k_key} {k} (Gemma 4 needs equal key and value "
                              "head sizes)")
    window = g.arch_get("attention.sliding_window")
    if SLIDING in layer_types and not window:
        raise ConfigError(f"{g.path}: missing metadata {g.arch}.attention.sliding_window")
    for i, k in enumerate(kv_heads):
        if k < 1 or heads % k:
            raise ConfigError(f"{g.path}: layer {i} has {k} key/value heads, which does not divide {heads} heads")
    experts = 0
    moe = [f"blk.{i}.ffn_gate_inp.weight" in g.tensors for i in range(n)]
    if any(moe):
        if not all(moe):
            raise ConfigError(f"{g.path}: experts (ffn_gate_inp) on some layers only; Gemma 4 MoE has them on all")
        experts = int(g.require("expert_count"))
    bos = g.get("tokenizer.ggml.bos_token_id")
    softcap = g.arch_get("final_logit_softcapping")
    return Gemma4Config(
        vocab_size=g.shape("token_embd.weight")[0], hidden_size=int(g.require("embedding_length")),
        intermediate_size=int(single_value(g.require("feed_forward_length"), "feed_forward_length", g.path)),
        num_hidden_layers=n, num_attention_heads=heads, layer_types=layer_types, layer_kv_heads=kv_heads,
        layer_head_dims=[swa_dim if t == SLIDING else full_dim for t in layer_types],
        sliding_window=int(window or 0), rope=_rope_specs(g, layer_types, full_dim, swa_dim),
        attention_k_eq_v=_k_eq_v(g, layer_types), attention_bias="blk.0.attn_q.bias" in g.tensors,
        rms_norm_eps=f32(g.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        final_logit_softcapping=f32(softcap) if softcap else None,
        max_position_embeddings=int(g.arch_get("context_length", 131_072)),
        tie_word_embeddings="output.weight" not in g.tensors, num_experts=experts,
        top_k_experts=int(g.require("expert_used_count")) if experts else 0,
        moe_intermediate_size=int(g.require("expert_feed_forward_length")) if experts else 0,
        eos_token_ids=_stop_ids(g), bos_token_id=int(bos) if bos is not None else None, model_type="gemma4")


# --- experts kept in their blocks ---

class _QuantStack:
    """Per-expert matrices [E, rows, cols] held as GGUF blocks [E, rows, row_bytes]: indexing dequantizes only
    the experts taken, so Gemma4Experts' gathered path (decoding) and expert loop read what they use."""

    def __init__(self, blocks: torch.Tensor, qtype: str, cols: int, dtype: torch.dtype):
        self.blocks, self.qtype, self.dtype = blocks, qtype, dtype
        self.shape = torch.Size((blocks.shape[0], blocks.shape[1], cols))

    def __getitem__(self, index) -> torch.Tensor:
        return dequantize(self.blocks[index], self.qtype).to(self.dtype)


class QuantGemma4Experts(Gemma4Experts):
    """Gemma4Experts whose gate_up_proj / down_proj may each stay quantized. The arithmetic is Gemma4Experts'
    own, on the dequantized experts, so results equal those of a float model holding the dequantized weights.

    pair_products (both projections quantized in types the GPU kernels read): passes of at most PAIR_TOKENS
    tokens (decoding, speculative verify) multiply each (token, chosen expert) pair's row by that expert's blocks
    directly (gguf_triton.launch_experts, through flashdraft.quant.gpu_kernels) instead of a dequantized copy,
    reading only the quantized bytes of the chosen experts, each pair's row the same product whatever the pass.
    Longer passes (prefill) take the dequantized path. Q6_K experts are then kept in lane order (the kernels'
    type)."""

    def __init__(self, gate_up: tuple[torch.Tensor, str], down: tuple[torch.Tensor, str], hidden: int,
                 intermediate: int, dtype: torch.dtype, pair_products: bool = False):
        nn.Module.__init__(self)
        self.dtype, self.qtypes, self.cols = dtype, {}, {"gate_up_proj": hidden, "down_proj": intermediate}
        given = {"gate_up_proj": gate_up, "down_proj": down}
        unreadable = [f"{name} {qtype}" for name, (_, qtype) in given.items() if not reads(qtype)]
        if pair_products and unreadable:
            raise ValueError(f"pair products need both expert projections in {sorted(PAIR_TYPES)}, got "
                             f"{', '.join(unreadable)}")
        self.pair_products = pair_products
        for name, (data, qtype) in given.items():
            if qtype in FLOAT_TYPES:
                setattr(self, f"{name}_weight", nn.Parameter(data.to(dtype), requires_grad=False))
            elif pair_products and qtype == q6k_lanes.GGUF_QTYPE:  # the kernels' Q6_K, row by row
                e, rows = data.shape[:2]
                data, qtype = q6k_lanes.from_gguf(data.reshape(e * rows, -1)).reshape(e, rows, -1), q6k_lanes.QTYPE
            if qtype not in FLOAT_TYPES:
                self.register_buffer(f"{name}_blocks", data)
            self.qtypes[name] = qtype

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        # (pair products are on only where Triton is: the device is what remains to check, without a cached
        # function, which dynamo warns of in compiled code)
        if self.pair_products and x.shape[0] <= self.PAIR_TOKENS and (x.is_cuda or interpreting()):
            return self._pairs(x, weights, experts)
        return super().forward(x, weights, experts)

    def _pairs(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each (token, choice) pair's row through its expert's blocks: the arithmetic of _gathered (products in
        x's dtype, GeGLU between, the weighted sum of the choices), each product one row's."""
        T, k = experts.shape
        ids = experts.reshape(T * k)
        rows = x[:, None, :].expand(T, k, x.shape[-1]).reshape(T * k, x.shape[-1])
        gate, up = expert_matmul(rows, self.gate_up_proj_blocks, ids, self.qtypes["gate_up_proj"]).chunk(2, dim=-1)
        y = expert_matmul(F.gelu(gate, approximate="tanh") * up, self.down_proj_blocks, ids,
                          self.qtypes["down_proj"])
        return weigh_choices(y.reshape(T, k, -1), weights).to(x.dtype)

    def _stack(self, name: str):
        if self.qtypes[name] in FLOAT_TYPES:
            return getattr(self, f"{name}_weight")
        return _QuantStack(getattr(self, f"{name}_blocks"), self.qtypes[name], self.cols[name], self.dtype)

    @property
    def gate_up_proj(self):
        return self._stack("gate_up_proj")

    @property
    def down_proj(self):
        return self._stack("down_proj")

    def _all_experts(self, x, weights, experts):
        dense = SimpleNamespace(gate_up_proj=self.gate_up_proj[:], down_proj=self.down_proj[:])
        return Gemma4Experts._all_experts(dense, x, weights, experts)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={q}" for n, q in self.qtypes.items())


def _expert_tensor(g: GGUFFile, inst: TensorInstaller, names: list[str], shape: tuple[int, ...],
                   device) -> tuple[torch.Tensor, str]:
    """One stacked expert tensor (or gate and up halves stacked along the rows), raw, with its type."""
    parts = []
    for name in names:
        if name not in g.tensors:
            raise CheckpointError(f"{g.path}: missing tensor {name!r}")
        try:
            parts.append((g.raw(name), g.qtype(name)))
        except UnsupportedQuantType as e:
            raise UnsupportedQuantType(f"{g.path}: tensor {name!r}: {e}") from None
        inst.used.add(name)
    got = (g.shape(names[0])[0], sum(g.shape(n)[1] for n in names), g.shape(names[0])[2])
    if got != shape or any(len(g.shape(n)) != 3 for n in names):
        raise CheckpointError(f"{g.path}: tensor(s) {names} have shape {[list(g.shape(n)) for n in names]}, "
                              f"expected {list(shape)} in all")
    qtypes = {q for _, q in parts}
    if len(qtypes) > 1:
        raise CheckpointError(f"{g.path}: {names} have different types {sorted(qtypes)}")
    qtype = qtypes.pop()
    data = torch.cat([p for p, _ in parts], dim=1) if len(parts) > 1 else parts[0][0]
    if qtype not in FLOAT_TYPES:
        expected = (shape[0], shape[1], block_format(qtype).row_bytes(shape[2]))
        if tuple(data.shape) != expected:
            raise CheckpointError(f"{g.path}: {names} blocks have shape {list(data.shape)}, expected {list(expected)}")
    return data.to(device), qtype


def _install_experts(g: GGUFFile, inst: TensorInstaller, model: Gemma4LM, i: int, device, dtype) -> None:
    cfg = model.config
    e, h, m = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    fused = f"blk.{i}.ffn_gate_up_exps.weight"
    names = [fused] if fused in g.tensors else [f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"]
    gate_up = _expert_tensor(g, inst, names, (e, 2 * m, h), device)
    down = _expert_tensor(g, inst, [f"blk.{i}.ffn_down_exps.weight"], (e, h, m), device)
    layer = model.model.layers[i]
    if gate_up[1] in FLOAT_TYPES and down[1] in FLOAT_TYPES:
        layer.experts.gate_up_proj = nn.Parameter(gate_up[0].to(device, dtype), requires_grad=False)
        layer.experts.down_proj = nn.Parameter(down[0].to(device, dtype), requires_grad=False)
    else:
        layer.experts = QuantGemma4Experts(gate_up, down, h, m, dtype, pair_products=(
            reads(gate_up[1]) and reads(down[1]) and pair_products_run_on(device)))


# --- loading ---

def _put(g: GGUFFile, inst: TensorInstaller, name: str, module_path: str, attr: str) -> None:
    if name not in g.tensors:
        owner = inst.model.get_submodule(module_path)
        raise CheckpointError(f"{g.path}: missing tensor {name!r} (expected shape "
                              f"{list(getattr(owner, attr).shape)})")
    inst.tensor(name, module_path, attr)


def load_gemma4_gguf_target(g: GGUFFile, device: torch.device, dtype: torch.dtype,
                            plan: LayerPlan = LayerPlan()) -> Gemma4LM:
    cfg = gemma4_gguf_config(g)
    with torch.device("meta"):
        model = Gemma4LM(cfg, plan)
    inst = TensorInstaller(g, model, device, dtype)
    _put(g, inst, "token_embd.weight", "model.embed_tokens", "weight")
    _put(g, inst, "output_norm.weight", "model.norm", "weight")
    if cfg.tie_word_embeddings:
        tie_lm_head(model, cfg.hidden_size, dtype)
    else:
        _put(g, inst, "output.weight", "lm_head", "weight")
    for i in range(cfg.num_hidden_layers):
        prefix, path = f"blk.{i}.", f"model.layers.{i}"
        for base, ours in _ATTN_TENSORS.items():
            if ours.endswith("v_proj") and cfg.uses_k_as_v(i):
                continue
            kinds = ("bias", "weight") if cfg.attention_bias else ("weight",)
            for kind in kinds:
                _put(g, inst, f"{prefix}{base}.{kind}", f"{path}.{ours}", kind)
        tensors = {**_LAYER_TENSORS, **(_MOE_TENSORS if cfg.num_experts else {})}
        for base, (ours, attr) in tensors.items():
            _put(g, inst, prefix + base, f"{path}.{ours}", attr)
        if f"{prefix}layer_output_scale.weight" in g.tensors:
            inst.tensor(f"{prefix}layer_output_scale.weight", path, "layer_scalar")
        else:  # optional in llama.cpp, which then scales by 1
            model.model.layers[i].layer_scalar = nn.Parameter(torch.ones(1, device=device, dtype=dtype),
                                                              requires_grad=False)
        if cfg.num_experts:
            _install_experts(g, inst, model, i, device, dtype)
    for kind in sorted(set(cfg.layer_types)):
        name = f"{kind}_inv_freq"
        setattr(model, name, getattr(model, name).to(device))
    inst.finish()
    return model.eval().requires_grad_(False)


def gemma4_gguf_drafter_config(g: GGUFFile, target: Gemma4Config) -> Gemma4DrafterConfig:
    """A DFlash drafter GGUF (either layout) for a Gemma 4 target: its layer types come from
    {arch}.attention.sliding_window_pattern (absent: every layer full and non-causal, as the file then says);
    sliding layers are causal windows of {arch}.attention.sliding_window, the full layers non-causal (z-lab's rule,
    as for safetensors drafters); block tokens are embedded as the target's first layer sees them."""
    base = gguf_drafter_config(g, target)
    n = base.layers.num_hidden_layers
    types = sliding_pattern(g, n, required=False) or [FULL] * n
    window = g.arch_get("attention.sliding_window")
    if SLIDING in types and not (window and int(window) >= 1):
        raise ConfigError(f"{g.path}: sliding layers need a positive {g.arch}.attention.sliding_window, got {window!r}")
    softcap = g.arch_get("final_logit_softcapping")
    return Gemma4DrafterConfig(
        layers=base.layers, block_size=base.block_size, mask_token_id=base.mask_token_id,
        target_layer_ids=base.target_layer_ids, num_target_layers=base.num_target_layers, layer_types=types,
        layer_causal=[t == SLIDING for t in types], sliding_window=int(window) if SLIDING in types else None,
        final_logit_softcapping=f32(softcap) if softcap else None, block_embedding_scale="target")


def load_gemma4_gguf_drafter(g: GGUFFile, target: Gemma4LM, max_positions: int,
                             plan: LayerPlan = LayerPlan()) -> Gemma4DFlashDrafter:
    cfg = gemma4_gguf_drafter_config(g, target.config)
    cfg.check_fits(target.config, g.path)
    with torch.device("meta"):
        drafter = Gemma4DFlashDrafter(cfg, max_positions, float(target.embed_scale), plan)
    return install_drafter(g, drafter, target, max_positions)
