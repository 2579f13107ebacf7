"""Load HF model folders (config.json + single or sharded safetensors) into our own modules."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flashdraft.config import ConfigError, DrafterConfig, ModelConfig, read_json
from flashdraft.config_gemma4 import GEMMA4_MODEL_TYPES, is_gemma4_folder
from flashdraft.models import DecoderLM, DFlashDrafter


class CheckpointError(ConfigError):
    """A checkpoint whose tensors do not fit the model; the message names the tensor."""


def model_folder(path: str | Path, what: str = "model") -> Path:
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ConfigError(f"{what} folder not found: {folder}")
    if not folder.is_dir():
        raise ConfigError(f"{what} path is not a folder: {folder} (expected a Hugging Face model folder)")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{what} folder {folder} has no config.json")
    return folder


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: the shards named in model.safetensors.index.json, or *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {folder}")
    return files


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    return tensors


def assign_tensors(module: nn.Module, tensors: dict[str, torch.Tensor], source: Path,
                   device: torch.device, dtype: torch.dtype, optional: set[str] = frozenset()) -> None:
    """Give every parameter its tensor, checking names and shapes; errors name the tensor at fault."""
    state = {}
    for name, param in module.named_parameters():
        if name not in tensors:
            if name in optional:
                continue
            raise CheckpointError(f"{source}: missing tensor {name!r} (expected shape {list(param.shape)})")
        t = tensors[name]
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(t.shape)}, expected {list(param.shape)}")
        state[name] = t.to(device=device, dtype=dtype)
    module.load_state_dict(state, strict=False, assign=True)


def default_device_dtype(device: str | torch.device | None, dtype: torch.dtype | None):
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype


def target_max_positions(folder: Path) -> int:
    if is_gemma4_folder(folder):
        from flashdraft.models.gemma4 import gemma4_max_positions  # imported here: it builds on this module
        return gemma4_max_positions(folder)
    return ModelConfig.from_file(folder / "config.json").max_position_embeddings


def load_target(path: str | Path, max_positions: int, device=None, dtype=None) -> DecoderLM:
    folder = model_folder(path, "model")
    if is_gemma4_folder(folder):
        from flashdraft.models.gemma4 import load_gemma4_target  # imported here: it builds on this module
        return load_gemma4_target(folder, device, dtype)
    cfg = ModelConfig.from_file(folder / "config.json")
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.is_file():
        eos = read_json(gen_cfg).get("eos_token_id")
        if eos is not None:
            extra = [eos] if isinstance(eos, int) else list(eos)
            cfg.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + [int(e) for e in extra]))
    device, dtype = default_device_dtype(device, dtype)
    with torch.device("meta"):
        model = DecoderLM(cfg, max_positions)
    tensors = read_tensors(folder)
    if "lm_head.weight" not in tensors:
        if not cfg.tie_word_embeddings and "model.embed_tokens.weight" not in tensors:
            raise CheckpointError(f"{folder}: missing tensor 'lm_head.weight'")
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")
    assign_tensors(model, tensors, folder, device, dtype)
    model.rope = model.rope.__class__(cfg, max_positions).to(device)
    return model.eval().requires_grad_(False)


def load_drafter(path: str | Path, target: DecoderLM, max_positions: int) -> DFlashDrafter:
    if getattr(target.config, "model_type", None) in GEMMA4_MODEL_TYPES:
        from flashdraft.models.gemma4_drafter import load_gemma4_drafter  # imported here: it builds on this module
        return load_gemma4_drafter(path, target, max_positions)
    folder = model_folder(path, "drafter")
    cfg = DrafterConfig.from_file(folder / "config.json")
    check_drafter_fits(cfg, target.config, folder)
    p = target.model.norm.weight  # the target's device and dtype (a float parameter even in GGUF models)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg, max_positions)
    assign_tensors(drafter, read_tensors(folder), folder, p.device, p.dtype)
    drafter.rope = drafter.rope.__class__(cfg.layers, max_positions).to(p.device)
    return drafter.eval().requires_grad_(False)


def check_drafter_fits(cfg: DrafterConfig, target: ModelConfig, source: Path) -> None:
    c = cfg.layers
    if c.hidden_size != target.hidden_size:
        raise ConfigError(f"{source}: drafter hidden_size {c.hidden_size} != target hidden_size {target.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ConfigError(f"{source}: target_layer_ids {bad} out of range for a target with "
                          f"{target.num_hidden_layers} layers")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ConfigError(f"{source}: mask_token_id {cfg.mask_token_id} is not a row of the target's "
                          f"embedding (vocab_size {target.vocab_size})")
