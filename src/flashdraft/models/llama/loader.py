"""Llama and Qwen3 targets and z-lab's DFlash drafters from Hugging Face folders (config.json, safetensors; names
as in the checkpoints)."""
from __future__ import annotations

from pathlib import Path

import torch

from flashdraft.config import DrafterConfig, ModelConfig, read_json
from flashdraft.layers.plan import LayerPlan
from flashdraft.loading.checkpoint import CheckpointError, assign_tensors, default_device_dtype, read_tensors
from flashdraft.models.llama.model import DecoderLM, DFlashDrafter


def load_llama_folder(folder: Path, max_positions: int, device=None, dtype=None,
                      plan: LayerPlan = LayerPlan()) -> DecoderLM:
    """The target in `folder`, its EOS ids joined by generation_config.json's, the LM head tied to the embedding
    where the checkpoint has none."""
    cfg = ModelConfig.from_file(folder / "config.json")
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.is_file():
        eos = read_json(gen_cfg).get("eos_token_id")
        if eos is not None:
            extra = [eos] if isinstance(eos, int) else list(eos)
            cfg.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + [int(e) for e in extra]))
    device, dtype = default_device_dtype(device, dtype)
    with torch.device("meta"):
        model = DecoderLM(cfg, max_positions, plan)
    tensors = read_tensors(folder)
    if "lm_head.weight" not in tensors:
        if not cfg.tie_word_embeddings and "model.embed_tokens.weight" not in tensors:
            raise CheckpointError(f"{folder}: missing tensor 'lm_head.weight'")
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")
    assign_tensors(model, tensors, folder, device, dtype)
    model.rope = model.rope.__class__(cfg, max_positions).to(device)
    return model.eval().requires_grad_(False)


def load_dflash_drafter(folder: Path, target, max_positions: int, plan: LayerPlan = LayerPlan()) -> DFlashDrafter:
    """A z-lab DFlash drafter from its Hugging Face folder, on the target's device and dtype."""
    cfg = DrafterConfig.from_file(folder / "config.json")
    cfg.check_fits(target.config, folder)
    p = target.model.norm.weight  # the target's device and dtype (a float parameter even in GGUF models)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg, max_positions, plan)
    assign_tensors(drafter, read_tensors(folder), folder, p.device, p.dtype)
    drafter.rope = drafter.rope.__class__(cfg.layers, max_positions).to(p.device)
    return drafter.eval().requires_grad_(False)
