"""Which loader builds a model: for an HF folder by config.json's model_type, for a GGUF file by its
general.architecture; targets and DFlash drafters (a drafter by its target's family). load_model puts a target,
its tokenizer and a drafter together.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.config import DrafterConfig, ModelConfig, is_gguf_path, read_json
from flashdraft.models.gemma4.config import GEMMA4_MODEL_TYPES
from flashdraft.layers.plan import LayerPlan
from flashdraft.loading.checkpoint import default_device_dtype, model_folder
from flashdraft.loading.gguf import GGUFFile, GGUFTokenizer, gguf_name
from flashdraft.loading.tokenizer import Tokenizer
from flashdraft.models.llama.model import DecoderLM, DFlashDrafter
from flashdraft.models.gemma4.model import gemma4_max_positions, load_gemma4_target
from flashdraft.models.gemma4.drafter import load_gemma4_drafter
from flashdraft.models.gemma4.gguf import gemma4_gguf_config, load_gemma4_gguf_drafter, load_gemma4_gguf_target
from flashdraft.models.gguf import GEMMA4_ARCH, drafter_settings
from flashdraft.models.llama.gguf import llama_target_config, load_llama_drafter, load_llama_target
from flashdraft.models.llama.loader import load_dflash_drafter, load_llama_folder


@dataclass(frozen=True)
class Family:
    """One model family's loaders: targets and their DFlash drafters, from HF folders and from GGUF files."""

    max_positions: Callable[[Path], int]  # a folder's context limit, from its config.json
    load_target: Callable[..., object]    # (folder, max_positions, device, dtype, plan)
    load_drafter: Callable[..., object]   # (path, target, max_positions, plan)
    gguf_config: Callable[[GGUFFile], object]
    load_gguf_target: Callable[..., object]   # (GGUFFile, max_positions, device, dtype, plan)
    load_gguf_drafter: Callable[..., object]  # (GGUFFile, target, max_positions, plan)


LLAMA = Family(
    max_positions=lambda folder: ModelConfig.from_file(folder / "config.json").max_position_embeddings,
    load_target=load_llama_folder,
    load_drafter=lambda path, target, max_positions, plan: load_dflash_drafter(
        model_folder(path, "drafter"), target, max_positions, plan),
    gguf_config=llama_target_config, load_gguf_target=load_llama_target, load_gguf_drafter=load_llama_drafter)
GEMMA4 = Family(
    max_positions=gemma4_max_positions,
    load_target=lambda folder, max_positions, device, dtype, plan: load_gemma4_target(folder, device, dtype, plan),
    load_drafter=load_gemma4_drafter, gguf_config=gemma4_gguf_config,
    load_gguf_target=lambda g, max_positions, device, dtype, plan: load_gemma4_gguf_target(g, device, dtype, plan),
    load_gguf_drafter=load_gemma4_gguf_drafter)
# An HF config's model_type or a GGUF file's general.architecture -> its family (a drafter goes by its target's
# model_type). Any other name goes to the Llama family's loaders, which refuse it naming what is supported.
ARCHITECTURES = {"llama": LLAMA, "qwen3": LLAMA, **{name: GEMMA4 for name in (*GEMMA4_MODEL_TYPES, GEMMA4_ARCH)}}


def family(architecture: str | None) -> Family:
    return ARCHITECTURES.get(architecture, LLAMA)


def _folder_family(folder: Path) -> Family:
    return family(read_json(Path(folder) / "config.json").get("model_type"))


def _target_family(target) -> Family:
    return family(getattr(target.config, "model_type", None))


def target_max_positions(folder: Path) -> int:
    return _folder_family(folder).max_positions(folder)


def load_target(path: str | Path, max_positions: int, device=None, dtype=None,
                plan: LayerPlan = LayerPlan()) -> DecoderLM:
    folder = model_folder(path, "model")
    return _folder_family(folder).load_target(folder, max_positions, device, dtype, plan)


def load_drafter(path: str | Path, target: DecoderLM, max_positions: int,
                 plan: LayerPlan = LayerPlan()) -> DFlashDrafter:
    return _target_family(target).load_drafter(path, target, max_positions, plan)


def gguf_target_config(g: GGUFFile):
    """The target's config: a ModelConfig (llama, qwen3) or a Gemma4Config (gemma4)."""
    return family(g.arch).gguf_config(g)


def load_gguf_target(g: GGUFFile, max_positions: int, device: torch.device, dtype: torch.dtype,
                     plan: LayerPlan = LayerPlan()):
    return family(g.arch).load_gguf_target(g, max_positions, device, dtype, plan)


def load_gguf_drafter(path: str | Path, target, max_positions: int, plan: LayerPlan = LayerPlan()):
    return _target_family(target).load_gguf_drafter(GGUFFile(path, "drafter"), target, max_positions, plan)


def drafter_block_size(path: str | Path) -> int:
    """The block a drafter drafts, from its config alone (before any model is built: the plan's row limit
    depends on it)."""
    if is_gguf_path(path):
        return drafter_settings(GGUFFile(path, "drafter"))[0]
    return DrafterConfig.from_file(model_folder(path, "drafter") / "config.json").block_size


@dataclass
class LoadedModel:
    target: object
    tokenizer: Tokenizer | None
    drafter: object | None
    context_size: int
    name: str


def load_model(model: str | Path, drafter: str | Path | None = None, device=None, dtype=None,
               context_size: int | None = None, overhang: int = 64, plan: LayerPlan = LayerPlan()) -> LoadedModel:
    """Target, tokenizer and optional drafter from their folders or .gguf files, built with `plan`; caches get
    `overhang` spare rows."""
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
    target = (load_gguf_target(gguf, ctx + overhang, device, dtype, plan) if gguf is not None
              else load_target(folder, ctx + overhang, device, dtype, plan))
    draft_loader = load_gguf_drafter if is_gguf_path(drafter) else load_drafter
    draft_model = draft_loader(drafter, target, ctx + overhang, plan) if drafter else None
    if draft_model is not None and draft_model.block_size > overhang:
        raise ValueError(f"drafter block_size {draft_model.block_size} is larger than supported ({overhang})")
    return LoadedModel(target, tokenizer, draft_model, ctx, name)
