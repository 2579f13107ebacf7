"""GGUF tensors into our modules, and DFlash drafters from llama.cpp GGUF files (flashdraft.loading.gguf reads
them); shared by the families' loaders (models.llama.gguf, models.gemma4.gguf).

Float tensors (F32/F16/BF16) become ordinary parameters in the model dtype; quantized tensors stay in their GGUF
blocks (flashdraft.quant.QuantLinear / QuantEmbedding), so a Q4_K file takes about as much memory as it does on
disk. Metadata gives the config and, for DFlash drafters, the block/tap settings in both the legacy "dflash-draft"
and the upstream "dflash" layouts. The drafter's embedding and LM head come from the target. The layer tables are
the Llama-style stack's, which targets of that family and every drafter share; flashdraft.models.registry picks
the loader by architecture.
"""
from __future__ import annotations


import torch
from torch import nn

from flashdraft.config import ConfigError, DrafterConfig, ModelConfig
from flashdraft.layers import RotaryEmbedding
from flashdraft.loading.checkpoint import CheckpointError
from flashdraft.loading.gguf import FLOAT_TYPES, GGUFFile, f32, single_value
from flashdraft.models.llama.model import DFlashDrafter
from flashdraft.quant import QuantEmbedding, QuantLinear, UnsupportedQuantType

GEMMA4_ARCH = "gemma4"  # loaded by flashdraft.models.gemma4.gguf into Gemma4LM
DRAFTER_ARCHS = ("dflash-draft", "dflash")

# Per-layer GGUF tensor -> our parameter (shared by targets and drafters; Qwen3 q/k norms when present).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Legacy "dflash-draft" names first, then the upstream "dflash" renames (beellama.md section 5).
DRAFTER_TENSORS = {"dflash_fc": "fc", "fc": "fc", "dflash_hidden_norm": "hidden_norm",
                   "enc.output_norm": "hidden_norm", "output_norm": "norm"}
DRAFTER_LAYER_RENAMES = {"post_attention_norm": "ffn_norm"}
# A drafter file may carry copies of the target's embedding/head; the target's are used.
DRAFTER_IGNORED = ("token_embd.weight", "output.weight")

def _rope_scaling(g: GGUFFile) -> dict | None:
    kind = g.arch_get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(g.require("rope.scaling.factor"))}
    raise ConfigError(f"{g.path}: unsupported rope scaling type {kind!r} (supported: none, linear, "
                      f"and llama3-style rope_freqs factors)")


def layer_stack_config(g: GGUFFile, model_type: str, vocab_size: int, **extra) -> ModelConfig:
    hidden = int(g.require("embedding_length"))
    heads = int(single_value(g.require("attention.head_count"), "attention.head_count", g.path))
    kv_heads = single_value(g.arch_get("attention.head_count_kv", heads), "attention.head_count_kv", g.path)
    raw = {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(single_value(g.require("feed_forward_length"), "feed_forward_length", g.path)),
        "num_hidden_layers": int(g.require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(g.arch_get("attention.key_length", hidden // heads)),
        "rms_norm_eps": f32(g.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": f32(g.arch_get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(g),
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        **extra,
    }
    cfg = ModelConfig.from_dict(raw, source=str(g.path))
    cfg.qk_norm = "blk.0.attn_q_norm.weight" in g.tensors
    return cfg


def drafter_settings(g: GGUFFile) -> tuple[int, int, list[int]]:
    """(block_size, mask_token_id, target_layer_ids in HF numbering) from either drafter layout."""
    if g.arch == "dflash-draft":
        block = g.arch_get("dflash.block_size", 16)
        mask = g.arch_get("dflash.mask_token_id", g.get("tokenizer.ggml.mask_token_id"))
        taps = g.arch_get("dflash.target_layer_ids")
        missing = "dflash-draft.dflash.target_layer_ids"
    else:
        block = g.arch_get("block_size", g.arch_get("dflash.block_size", 16))
        mask = g.get("tokenizer.ggml.mask_token_id", g.arch_get("mask_token_id"))
        # llama.cpp's converter stores HF hidden_states indices: the output of layer i is index i + 1.
        layers = g.arch_get("target_layers")
        taps = [int(i) - 1 for i in layers] if layers is not None else None
        missing = "dflash.target_layers"
    if taps is None:
        raise ConfigError(f"{g.path}: missing metadata {missing}")
    if mask is None:
        raise ConfigError(f"{g.path}: no mask token id (tokenizer.ggml.mask_token_id or {g.arch}.dflash.mask_token_id)")
    return int(block), int(mask), [int(i) for i in taps]


def gguf_drafter_config(g: GGUFFile, target: ModelConfig) -> DrafterConfig:
    if g.arch not in DRAFTER_ARCHS:
        raise ConfigError(f"{g.path}: GGUF architecture {g.arch!r} is not a DFlash drafter "
                          f"(expected one of {', '.join(DRAFTER_ARCHS)})")
    block, mask, taps = drafter_settings(g)
    if block < 2:
        raise ConfigError(f"{g.path}: block_size must be >= 2, got {block}")
    qk_norm = "blk.0.attn_q_norm.weight" in g.tensors
    layers = layer_stack_config(g, "qwen3" if qk_norm else "llama", target.vocab_size,
                                 max_position_embeddings=int(g.arch_get("context_length",
                                                                        target.max_position_embeddings)))
    return DrafterConfig(layers=layers, block_size=block, mask_token_id=mask, target_layer_ids=taps,
                         num_target_layers=target.num_hidden_layers)


def _unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's LlamaModel.permute on the rows of a q/k weight (float rows or block rows) or bias."""
    n = t.shape[0]
    return t.reshape(n_head, n // n_head // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def _submodule(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, attr = path.rpartition(".")
    return (root.get_submodule(parent) if parent else root), attr


class TensorInstaller:
    """Puts GGUF tensors into a model built on the meta device, checking names, shapes and types."""

    def __init__(self, g: GGUFFile, model: nn.Module, device: torch.device, dtype: torch.dtype):
        self.g, self.model, self.device, self.dtype = g, model, device, dtype
        self.used: set[str] = set()

    def tensor(self, gguf_name: str, module_path: str, attr: str, permute_heads: int | None = None) -> None:
        module = self.model.get_submodule(module_path)
        param = getattr(module, attr)
        expected = tuple(param.shape)
        if self.g.shape(gguf_name) != expected:
            raise CheckpointError(f"{self.g.path}: tensor {gguf_name!r} has shape {list(self.g.shape(gguf_name))}, "
                                  f"expected {list(expected)} (for {module_path}.{attr})")
        try:
            data = self.g.raw(gguf_name)
        except UnsupportedQuantType as e:
            raise UnsupportedQuantType(f"{self.g.path}: tensor {gguf_name!r}: {e}") from None
        if permute_heads:
            data = _unpermute_rows(data, permute_heads)
        self.used.add(gguf_name)
        qtype = self.g.qtype(gguf_name)
        if qtype in FLOAT_TYPES:
            setattr(module, attr, nn.Parameter(data.to(self.device, self.dtype), requires_grad=False))
        else:
            self._quantized(gguf_name, module_path, module, attr, data, qtype)

    def _quantized(self, gguf_name, module_path, module, attr, blocks, qtype):
        """The module holding these blocks, built where they were read (a re-layout, Q6_K's, then takes no device
        memory beside the tensor), then moved to the device."""
        if attr != "weight" or not isinstance(module, (nn.Linear, nn.Embedding)):
            raise CheckpointError(f"{self.g.path}: tensor {gguf_name!r} is {qtype}-quantized, but only "
                                  f"matrix weights may be (not {module_path}.{attr})")
        if isinstance(module, nn.Embedding):
            replacement = QuantEmbedding(blocks, qtype, module.embedding_dim, self.dtype)
        else:
            bias = module.bias if module.bias is not None and not module.bias.is_meta else None
            replacement = QuantLinear(blocks, qtype, module.in_features, self.dtype, bias, by_columns=True)
        parent, name = _submodule(self.model, module_path)
        setattr(parent, name, replacement.to(self.device))

    def layer(self, prefix: str, i: int, cfg: ModelConfig, permute_qk: bool, renames: dict) -> None:
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads} if permute_qk else {}
        present = {n for n in self.g.tensors if n.startswith(f"blk.{i}.")}
        for gguf_base, ours in LAYER_TENSORS.items():
            for kind in ("bias", "weight"):  # a quantized weight's QuantLinear takes the loaded bias
                path = f"{prefix}layers.{i}.{ours}"
                try:
                    owner = self.model.get_submodule(path)
                except AttributeError:
                    continue  # e.g. q_norm on a model without qk norm (then the tensor shows as unexpected)
                if getattr(owner, kind, None) is None:
                    continue
                names = [f"blk.{i}.{gguf_base}.{kind}"] + [f"blk.{i}.{old}.{kind}" for old, new in renames.items()
                                                            if new == gguf_base]
                name = next((n for n in names if n in present), None)
                if name is None:
                    raise CheckpointError(f"{self.g.path}: missing tensor {names[0]!r} "
                                          f"(expected shape {list(getattr(owner, kind).shape)})")
                self.tensor(name, path, kind, heads.get(gguf_base))

    def finish(self, ignored: tuple[str, ...] = ()) -> None:
        extra = sorted(set(self.g.tensors) - self.used - set(ignored) - {"rope_freqs.weight"})
        if extra:
            raise CheckpointError(f"{self.g.path}: unexpected tensor(s) for a {self.g.arch} model: {extra[:8]}")
        left = [n for n, p in [*self.model.named_parameters(), *self.model.named_buffers()] if p.is_meta]
        if left:
            raise CheckpointError(f"{self.g.path}: no tensor for {left[:8]}")


def gguf_rope(g: GGUFFile, cfg: ModelConfig, max_positions: int, device) -> RotaryEmbedding:
    """The RoPE tables; llama3-style scaling comes as per-frequency divisors in rope_freqs.weight."""
    rope = RotaryEmbedding(cfg, max_positions)
    if "rope_freqs.weight" in g.tensors:
        factors = g.raw("rope_freqs.weight").float().flatten()
        if factors.numel() != cfg.head_dim // 2:
            raise CheckpointError(f"{g.path}: rope_freqs.weight has {factors.numel()} values, "
                                  f"expected head_dim/2 = {cfg.head_dim // 2}")
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float()
                                             / cfg.head_dim)) / factors
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        rope.cos, rope.sin = emb.cos(), emb.sin()
    return rope.to(device)


def tie_lm_head(model: nn.Module, hidden_size: int, dtype: torch.dtype) -> None:
    """The LM head reads the embedding's weights: the same blocks when they are quantized."""
    emb = model.model.embed_tokens
    if isinstance(emb, QuantEmbedding):
        model.lm_head = QuantLinear(emb.blocks, emb.qtype, hidden_size, dtype)  # the embedding's blocks, shared
    else:
        model.lm_head.weight = emb.weight


def install_drafter(g: GGUFFile, drafter: DFlashDrafter, target, max_positions: int) -> DFlashDrafter:
    """Load a drafter built on the meta device from g (either layout), on the target's device and dtype."""
    cfg = drafter.config
    ref = target.model.norm.weight  # a float parameter: the target's device and compute dtype
    inst = TensorInstaller(g, drafter, ref.device, ref.dtype)
    for gguf_base, ours in DRAFTER_TENSORS.items():
        if f"{gguf_base}.weight" in g.tensors:
            inst.tensor(f"{gguf_base}.weight", ours, "weight")
    for i in range(cfg.layers.num_hidden_layers):
        inst.layer("", i, cfg.layers, False, DRAFTER_LAYER_RENAMES)
    drafter.rope = gguf_rope(g, cfg.layers, max_positions, ref.device)
    inst.finish(ignored=DRAFTER_IGNORED)
    return drafter.eval().requires_grad_(False)


