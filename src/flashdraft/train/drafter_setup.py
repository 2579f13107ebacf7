"""A new drafter for a target: its config (z-lab layout), mask token, initial weights, and saving."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashdraft.config import ConfigError, DrafterConfig, ModelConfig, default_tap_ids
from flashdraft.loading import Tokenizer
from flashdraft.models import DFlashDrafter

_MASK_NAME = re.compile(r"^\W*mask\W*$", re.IGNORECASE)  # <|mask|>, <mask>, [MASK]


def resolve_mask_token(tokenizer: Tokenizer, target: ModelConfig, explicit: int | None = None) -> int:
    """The block's mask token: an existing row of the target embedding that the target never needs to emit.

    Order: the explicit id; a special token named like <|mask|>; a reserved special token; the first embedding
    row past the tokenizer's vocabulary (z-lab's choice for Qwen3, 151669).
    """
    stops = set(target.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
    if explicit is not None:
        if not 0 <= explicit < target.vocab_size:
            raise ValueError(f"--mask-token-id {explicit} is not a row of the target embedding "
                             f"(vocab_size {target.vocab_size})")
        if explicit in stops:
            raise ValueError(f"--mask-token-id {explicit} is an end-of-sequence token of the target; pick another")
        return explicit
    added = {i: t.content for i, t in tokenizer.hf.added_tokens_decoder.items() if i < target.vocab_size}
    named = sorted(i for i, c in added.items() if _MASK_NAME.match(c) and i not in stops)
    if named:
        return named[0]
    reserved = sorted(i for i, c in added.items() if "reserved" in c.lower() and i not in stops)
    if reserved:
        return reserved[0]
    if len(tokenizer.hf) < target.vocab_size:
        return len(tokenizer.hf)
    raise ValueError("no mask token: the tokenizer has no <|mask|>-like or reserved special token and the "
                     "embedding has no spare row past the tokenizer's vocabulary; pass --mask-token-id ID "
                     "(an id the target never emits)")


def make_drafter_config(target: ModelConfig, layers: int, block_size: int, mask_token_id: int,
                        tap_ids: list[int] | None = None) -> DrafterConfig:
    """Qwen3-style drafter layers of the target's width (z-lab's drafts are Qwen3 whatever the target)."""
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    if not 2 <= block_size <= 64:
        raise ValueError(f"--block-size must be between 2 and 64, got {block_size}")
    tap_ids = list(tap_ids) if tap_ids else default_tap_ids(target.num_hidden_layers, layers)
    bad = [i for i in tap_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ValueError(f"tap ids {bad} out of range: the target has layers 0..{target.num_hidden_layers - 1}")
    # Plain RoPE with the target's theta: the z-lab config carries no rope_scaling.
    layer_cfg = dataclasses.replace(target, model_type="qwen3", qk_norm=True, num_hidden_layers=layers,
                                    rope_scaling=None, attention_bias=False, mlp_bias=False,
                                    tie_word_embeddings=False, eos_token_ids=[], bos_token_id=None)
    return DrafterConfig(layers=layer_cfg, block_size=block_size, mask_token_id=mask_token_id,
                         target_layer_ids=tap_ids, num_target_layers=target.num_hidden_layers)


def init_drafter(cfg: DrafterConfig, max_positions: int, seed: int, std: float = 0.02) -> DFlashDrafter:
    """Random weights as HF initialises Qwen3 (normal(0, std) linears, unit norms)."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg, max_positions)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
    return drafter


def save_drafter(drafter: DFlashDrafter, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors in z-lab's layout: fc, hidden_norm, norm, layers.N.* (no embedding, no head)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def check_compatible(cfg: DrafterConfig, saved: dict, source: str) -> None:
    """A checkpoint resumes only into the same drafter shape and settings."""
    if saved != cfg.to_dict():
        diff = sorted(k for k in saved.keys() | cfg.to_dict().keys() if saved.get(k) != cfg.to_dict().get(k))
        raise ConfigError(f"{source} was made for another drafter configuration ({', '.join(diff)} differ); "
                          f"use the same options or another --out")
