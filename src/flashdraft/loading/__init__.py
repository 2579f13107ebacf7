"""Model loading: HF folders (config.json + safetensors + tokenizer) into our own modules."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashdraft.loading.checkpoint import (CheckpointError, default_device_dtype, load_drafter, load_target,
                                           model_folder, target_max_positions)
from flashdraft.loading.gguf_loader import (GGUFFile, GGUFTokenizer, gguf_name, gguf_target_config, is_gguf_path,
                                            load_gguf_drafter, load_gguf_target)
from flashdraft.loading.tokenizer import Tokenizer

__all__ = ["CheckpointError", "LoadedModel", "Tokenizer", "load_drafter", "load_model", "load_target"]


@dataclass
class LoadedModel:
    target: object
    tokenizer: Tokenizer | None
    drafter: object | None
    context_size: int
    name: str


def load_model(model: str | Path, drafter: str | Path | None = None, device=None, dtype=None,
               context_size: int | None = None, overhang: int = 64) -> LoadedModel:
    """Target, tokenizer and optional drafter from their folders or .gguf files; caches get `overhang` spare rows."""
    gguf = GGUFFile(model, "model") if is_gguf_path(model) else None
    if gguf is not None:
        max_pos, tokenizer, name = gguf_target_config(gguf).max_position_embeddings, GGUFTokenizer(gguf), gguf_name(gguf)
    else:
        folder = model_folder(model, "model")
        max_pos = target_max_positions(folder)  # validates config.json before anything else reads it
        tokenizer, name = Tokenizer(folder), folder.name
    device, dtype = default_device_dtype(device, dtype)
    if context_size is not None and context_size < 2:
        raise ValueError(f"context size must be at least 2 tokens, got {context_size}")
    ctx = min(context_size, max_pos) if context_size else min(max_pos, 8192)
    target = (load_gguf_target(gguf, ctx + overhang, device, dtype) if gguf is not None
              else load_target(folder, ctx + overhang, device, dtype))
    draft_loader = load_gguf_drafter if is_gguf_path(drafter) else load_drafter
    draft_model = draft_loader(drafter, target, ctx + overhang) if drafter else None
    if draft_model is not None and draft_model.block_size > overhang:
        raise ValueError(f"drafter block_size {draft_model.block_size} is larger than supported ({overhang})")
    return LoadedModel(target, tokenizer, draft_model, ctx, name)
