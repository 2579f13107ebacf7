"""Llama and Qwen3 targets, and their DFlash drafters, from llama.cpp GGUF files."""
from __future__ import annotations

import torch

from flashdraft.config import ConfigError, ModelConfig
from flashdraft.layers.plan import LayerPlan
from flashdraft.loading.checkpoint import CheckpointError
from flashdraft.loading.gguf import GGUFFile, eos_ids
from flashdraft.loading.gguf_tokenizer import special_token_id
from flashdraft.models.gguf import (DRAFTER_ARCHS, GEMMA4_ARCH, TensorInstaller, gguf_drafter_config, gguf_rope,
                                    install_drafter, layer_stack_config, tie_lm_head)
from flashdraft.models.llama.model import DecoderLM, DFlashDrafter

# general.architecture -> our model_type. llama.cpp stores Llama's q/k rows permuted for its interleaved RoPE.
TARGET_ARCHS = {"llama": "llama", "qwen3": "qwen3"}
PERMUTED_QK_ARCHS = ("llama",)
SUPPORTED_TARGET_ARCHS = (*TARGET_ARCHS, GEMMA4_ARCH)
TARGET_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def llama_target_config(g: GGUFFile) -> ModelConfig:
    """A llama or qwen3 target's config."""
    if g.arch not in TARGET_ARCHS:
        hint = " (a DFlash drafter: pass it as the drafter)" if g.arch in DRAFTER_ARCHS else ""
        raise ConfigError(f"{g.path}: unsupported GGUF architecture {g.arch!r}{hint}; "
                          f"supported: {', '.join(SUPPORTED_TARGET_ARCHS)}")
    if "token_embd.weight" not in g.tensors:
        raise CheckpointError(f"{g.path}: missing tensor 'token_embd.weight'")
    bos = special_token_id(g, "bos")
    # The embedding's rows, not the token list: llama.cpp pads one or the other.
    return layer_stack_config(
        g, TARGET_ARCHS[g.arch], g.shape("token_embd.weight")[0],
        max_position_embeddings=int(g.arch_get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in g.tensors,
        eos_token_id=eos_ids(g), bos_token_id=bos)


def load_llama_target(g: GGUFFile, max_positions: int, device: torch.device, dtype: torch.dtype,
                      plan: LayerPlan = LayerPlan()) -> DecoderLM:
    cfg = llama_target_config(g)
    with torch.device("meta"):
        model = DecoderLM(cfg, max_positions, plan)
    inst = TensorInstaller(g, model, device, dtype)
    for gguf_base, ours in TARGET_TENSORS.items():
        name = f"{gguf_base}.weight"
        if name in g.tensors:
            inst.tensor(name, ours, "weight")
        elif gguf_base != "output":
            raise CheckpointError(f"{g.path}: missing tensor {name!r}")
    if cfg.tie_word_embeddings:
        tie_lm_head(model, cfg.hidden_size, dtype)
    for i in range(cfg.num_hidden_layers):
        inst.layer("model.", i, cfg, g.arch in PERMUTED_QK_ARCHS, {})
    model.rope = gguf_rope(g, cfg, max_positions, device)
    inst.finish()
    return model.eval().requires_grad_(False)


def load_llama_drafter(g: GGUFFile, target: DecoderLM, max_positions: int,
                       plan: LayerPlan = LayerPlan()) -> DFlashDrafter:
    """A DFlash drafter (either layout) for a llama or qwen3 target."""
    target_type = getattr(target.config, "model_type", None)
    if target_type not in TARGET_ARCHS.values():
        raise ConfigError(f"{g.path}: GGUF drafters are supported for "
                          f"{', '.join((*TARGET_ARCHS.values(), GEMMA4_ARCH))} targets, not {target_type!r}")
    cfg = gguf_drafter_config(g, target.config)
    cfg.check_fits(target.config, g.path)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg, max_positions, plan)
    return install_drafter(g, drafter, target, max_positions)
