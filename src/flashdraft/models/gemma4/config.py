"""Gemma 4 configuration: the text part of a Gemma 4 checkpoint's config.json, and Gemma DFlash drafter settings.

Two config spellings exist for the full-attention layers' shape: the published checkpoints write
`global_head_dim` / `num_global_key_value_heads`, newer transformers versions write a `per_layer_config` map
(layer index -> overrides). Both are read. Defaults for missing keys are transformers' Gemma4TextConfig defaults,
so a folder means the same thing here as there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.config import ConfigError, DrafterConfig, as_id_list, read_json

GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text")
SLIDING, FULL = "sliding_attention", "full_attention"

# Tokens that end a Gemma 4 turn: <eos> (1), <turn|> (106, the end of a model turn) and <|tool_response> (50: the
# model stops to wait for a tool's answer; llama.cpp treats it as end-of-generation too). Looked up by content in
# the tokenizer, so a folder with another vocabulary never gets wrong ids.
STOP_TOKENS = ("<eos>", "<turn|>", "<|tool_response>")

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_LAYER_OVERRIDE_KEYS = {"head_dim", "num_key_value_heads"}


@dataclass
class RopeSpec:
    """One layer type's RoPE: theta, and for "proportional" the rotated share of the head (the rest passes)."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass
class Gemma4Config:
    """The Gemma 4 text decoder (dense 31B layout, or the 26B-A4B mixture of experts when num_experts is set)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: list[str]
    layer_kv_heads: list[int]       # per layer: sliding layers num_key_value_heads, full layers the global count
    layer_head_dims: list[int]      # per layer: 256-style sliding heads, 512-style full heads
    sliding_window: int
    rope: dict[str, RopeSpec]
    attention_k_eq_v: bool = False  # full layers: no v_proj, values are the raw key projection
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    num_experts: int = 0            # 0: dense MLP only
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = 2
    model_type: str = "gemma4"

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def uses_k_as_v(self, layer: int) -> bool:
        return self.attention_k_eq_v and not self.is_sliding(layer)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Gemma4Config":
        model_type = raw.get("model_type")
        if model_type == "gemma4":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: a gemma4 config needs a text_config object")
            tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        elif model_type == "gemma4_text":
            text, tie = raw, raw.get("tie_word_embeddings", True)
        else:
            raise ConfigError(f"{source}: not a Gemma 4 config (model_type={model_type!r})")
        _reject_unsupported(text, source)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in text]
        if missing:
            raise ConfigError(f"{source}: text config is missing required field(s) {missing}")
        n = int(text["num_hidden_layers"])
        layer_types = _layer_types(text, n, source)
        kv_heads, head_dims = _layer_shapes(text, layer_types, source)
        experts = int(text.get("num_experts") or 0) if text.get("enable_moe_block") else 0
        if experts and not (text.get("top_k_experts") and text.get("moe_intermediate_size")):
            raise ConfigError(f"{source}: enable_moe_block needs top_k_experts and moe_intermediate_size")
        eos = as_id_list(text.get("eos_token_id", raw.get("eos_token_id", 1)))
        return cls(
            vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]), num_hidden_layers=n,
            num_attention_heads=int(text["num_attention_heads"]), layer_types=layer_types,
            layer_kv_heads=kv_heads, layer_head_dims=head_dims,
            sliding_window=int(text.get("sliding_window", 512)), rope=_rope_specs(text, layer_types, source),
            attention_k_eq_v=bool(text.get("attention_k_eq_v", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=_optional_float(text.get("final_logit_softcapping")),
            max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
            tie_word_embeddings=bool(tie), num_experts=experts,
            top_k_experts=int(text.get("top_k_experts") or 0) if experts else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if experts else 0,
            eos_token_ids=eos, bos_token_id=text.get("bos_token_id", 2), model_type=model_type)

    @classmethod
    def from_folder(cls, folder: Path) -> "Gemma4Config":
        """config.json, plus the stop ids of generation_config.json and the tokenizer's turn-ending tokens."""
        folder = Path(folder)
        cfg = cls.from_dict(read_json(folder / "config.json"), str(folder / "config.json"))
        extra = []
        gen = folder / "generation_config.json"
        if gen.is_file():
            extra += as_id_list(read_json(gen).get("eos_token_id"))
        extra += stop_token_ids(folder)
        cfg.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + extra))
        return cfg


def stop_token_ids(folder: Path) -> list[int]:
    """Ids of STOP_TOKENS in the folder's tokenizer files (tokenizer.json, tokenizer_config.json), if present."""
    folder = Path(folder)
    by_content: dict[str, int] = {}
    tok = folder / "tokenizer.json"
    if tok.is_file():
        data = json.loads(tok.read_text())
        by_content.update({t["content"]: int(t["id"]) for t in data.get("added_tokens", [])})
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            by_content.update({s: int(vocab[s]) for s in STOP_TOKENS if s in vocab and s not in by_content})
    tok_cfg = folder / "tokenizer_config.json"
    if tok_cfg.is_file():
        for i, t in (json.loads(tok_cfg.read_text()).get("added_tokens_decoder") or {}).items():
            by_content.setdefault(t.get("content"), int(i))
    return [by_content[s] for s in STOP_TOKENS if s in by_content]


def reasoning_template_kwargs(enabled: bool) -> dict[str, bool]:
    """Chat-template variables for thinking on/off. With it off, the 31B/26B template ends the generation prompt
    with an empty thought channel (<|channel>thought\\n<channel|>), so the model answers directly."""
    return {"enable_thinking": bool(enabled)}


def _reject_unsupported(text: dict[str, Any], source: str) -> None:
    if text.get("hidden_size_per_layer_input", 256):
        raise ConfigError(f"{source}: per-layer input embeddings (hidden_size_per_layer_input, Gemma 4 E2B/E4B) "
                          "are not supported; the 31B and 26B-A4B layouts are")
    if text.get("num_kv_shared_layers", 0):
        raise ConfigError(f"{source}: KV-shared layers (num_kv_shared_layers) are not supported")
    if text.get("use_bidirectional_attention") == "all":
        raise ConfigError(f"{source}: use_bidirectional_attention='all' (an encoder layout) is not supported")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (expected gelu_pytorch_tanh)")


def _layer_types(text: dict[str, Any], n: int, source: str) -> list[str]:
    types = text.get("layer_types")
    if types is None:  # transformers' default: five sliding layers, then one full
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise ConfigError(f"{source}: layer_types has {len(types)} entries for {n} layers")
    bad = sorted({t for t in types if t not in (SLIDING, FULL)})
    if bad:
        raise ConfigError(f"{source}: unknown layer type(s) {bad} (expected {SLIDING!r} or {FULL!r})")
    types[-1] = FULL  # transformers forces the last layer to full attention
    return types


def _layer_shapes(text: dict[str, Any], types: list[str], source: str) -> tuple[list[int], list[int]]:
    heads = int(text["num_attention_heads"])
    kv = int(text.get("num_key_value_heads") or heads)
    hd = int(text.get("head_dim") or 256)
    kv_heads, head_dims = [kv] * len(types), [hd] * len(types)
    overrides = text.get("per_layer_config")
    if overrides is None:  # the published spelling
        global_kv = text.get("num_global_key_value_heads")
        overrides = {}
        for i, t in enumerate(types):
            if t == FULL:
                o = {"head_dim": text.get("global_head_dim", 512)}
                # As transformers: the global kv-head count applies where attention_k_eq_v is set.
                if global_kv is not None and text.get("attention_k_eq_v", False):
                    o["num_key_value_heads"] = global_kv
                overrides[i] = o
    if not isinstance(overrides, dict):
        raise ConfigError(f"{source}: per_layer_config must be an object mapping layer index to overrides")
    for key, o in overrides.items():
        try:
            i = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: per_layer_config key {key!r} is not a layer index") from None
        if not 0 <= i < len(types):
            raise ConfigError(f"{source}: per_layer_config names layer {i}, outside 0..{len(types) - 1}")
        unknown = sorted(set(o) - _LAYER_OVERRIDE_KEYS)
        if unknown:
            raise ConfigError(f"{source}: per_layer_config[{key}] overrides {unknown}, which are not supported")
        kv_heads[i] = int(o.get("num_key_value_heads", kv_heads[i]))
        head_dims[i] = int(o.get("head_dim", head_dims[i]))
    for i, k in enumerate(kv_heads):
        if k < 1 or heads % k:
            raise ConfigError(f"{source}: layer {i} has {k} key/value heads, which does not divide {heads} heads")
    return kv_heads, head_dims


def _rope_specs(text: dict[str, Any], types: list[str], source: str) -> dict[str, RopeSpec]:
    params = text.get("rope_parameters") or _DEFAULT_ROPE
    specs = {}
    for t in sorted(set(types)):
        p = params.get(t)
        if not isinstance(p, dict):
            raise ConfigError(f"{source}: rope_parameters has no entry for {t!r}")
        kind = p.get("rope_type", "default")
        if kind not in ("default", "proportional"):
            raise ConfigError(f"{source}: rope_type {kind!r} for {t} is not supported (default, proportional)")
        specs[t] = RopeSpec(rope_type=kind, theta=float(p.get("rope_theta", _DEFAULT_ROPE[t]["rope_theta"])),
                            partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)),
                            factor=float(p.get("factor", 1.0)))
    return specs


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


# How the drafter's block tokens are embedded. "target": exactly as the target's first layer sees them (Gemma's
# sqrt(hidden) scale, rounded to the weight dtype), as vLLM does for Gemma 4 targets. "none": the raw embedding
# rows, as z-lab's Transformers loop and llama.cpp's dflash graph do. docs/gemma4.md says why the default is "target".
BLOCK_EMBEDDING_SCALES = ("target", "none")


@dataclass
class Gemma4DrafterConfig(DrafterConfig):
    """A DFlash drafter for a Gemma 4 target: per-layer attention types (causal sliding windows, a non-causal
    full layer), plus the block-embedding choice. The drafter's own config says model_type "qwen3"."""

    layer_types: list[str] = field(default_factory=list)
    layer_causal: list[bool] = field(default_factory=list)
    sliding_window: int | None = None
    final_logit_softcapping: float | None = None
    block_embedding_scale: str = "target"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Gemma4DrafterConfig":
        base = DrafterConfig.from_dict(raw, source)
        n = base.layers.num_hidden_layers
        dflash = raw.get("dflash_config") or {}
        types = list(raw.get("layer_types") or [FULL] * n)
        if len(types) != n:
            raise ConfigError(f"{source}: layer_types has {len(types)} entries for {n} drafter layers")
        bad = sorted({t for t in types if t not in (SLIDING, FULL)})
        if bad:
            raise ConfigError(f"{source}: unknown layer type(s) {bad} (expected {SLIDING!r} or {FULL!r})")
        window = dflash.get("swa_window_size", raw.get("sliding_window"))
        if SLIDING in types and not (isinstance(window, int) and window >= 1):
            raise ConfigError(f"{source}: sliding_attention layers need a positive integer sliding_window, "
                              f"got {window!r}")
        # z-lab's rule: sliding layers are causal, full layers are not, unless the config says otherwise.
        forced = raw.get("is_causal", dflash.get("causal"))
        causal = [bool(forced) if forced is not None else t == SLIDING for t in types]
        scale = dflash.get("block_embedding_scale", raw.get("block_embedding_scale", "target"))
        if scale not in BLOCK_EMBEDDING_SCALES:
            raise ConfigError(f"{source}: block_embedding_scale {scale!r} must be one of {BLOCK_EMBEDDING_SCALES}")
        return cls(layers=base.layers, block_size=base.block_size, mask_token_id=base.mask_token_id,
                   target_layer_ids=base.target_layer_ids, num_target_layers=base.num_target_layers,
                   layer_types=types, layer_causal=causal, sliding_window=window if SLIDING in types else None,
                   final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
                   block_embedding_scale=scale)

    def to_dict(self) -> dict[str, Any]:
        """z-lab's Gemma drafter layout (model_type qwen3 plus layer_types, sliding_window and softcapping)."""
        out = super().to_dict()
        out["layer_types"] = list(self.layer_types)
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            out["use_sliding_window"] = True
        out["final_logit_softcapping"] = self.final_logit_softcapping
        if self.block_embedding_scale != "target":
            out["dflash_config"]["block_embedding_scale"] = self.block_embedding_scale
        return out
