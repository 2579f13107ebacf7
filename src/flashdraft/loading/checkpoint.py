"""HF model folders: config.json and single or sharded safetensors, read and assigned to a module's parameters
by name (the models' loaders use these), and the checks that name what does not fit."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flashdraft.config import ConfigError


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
