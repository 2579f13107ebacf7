"""llama.cpp GGUF files: the memory-mapped reader (metadata by key, tensors in their blocks) and the tokenizer
their metadata describes (gguf_tokenizer.py builds it, with its chat template and EOS ids). What the tensors
become is flashdraft.models.gguf's (Llama, Qwen3, DFlash drafters) and flashdraft.models.gemma4.gguf's.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from flashdraft.config import ConfigError
from flashdraft.loading.gguf_tokenizer import build_hf_tokenizer, special_token_id
from flashdraft.loading.tokenizer import Tokenizer
from flashdraft.quant import block_format

FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFFile:
    """A memory-mapped GGUF file: metadata by key and tensors by name."""

    def __init__(self, path: str | Path, what: str = "model"):
        from gguf import GGUFReader

        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ConfigError(f"{what} GGUF file not found: {self.path}")
        try:
            # Copy-on-write mapping: tensors share the file's pages and torch gets writable arrays.
            self.reader = GGUFReader(self.path, "c")
        except Exception as e:  # the reader raises ValueError/struct errors/... on a damaged file
            raise ConfigError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._values: dict = {}  # decoded metadata (the token list of a large vocabulary is slow to decode)
        self.arch = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise ConfigError(f"{self.path}: missing general.architecture")

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        if key not in self._values:
            self._values[key] = field.contents()
        return self._values[key]

    def arch_get(self, key: str, default=None):
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        value = self.arch_get(key)
        if value is None:
            raise ConfigError(f"{self.path}: missing metadata {self.arch}.{key}")
        return value

    def qtype(self, name: str) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.tensors[name].tensor_type).name

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape in torch order ([out_features, in_features] for a matrix)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def raw(self, name: str) -> torch.Tensor:
        """Float tensors in their own dtype and logical shape; quantized ones as uint8 [rows, row_bytes]."""
        data = torch.from_numpy(self.tensors[name].data)
        qtype = self.qtype(name)
        if qtype == "BF16":
            return data.view(torch.bfloat16)
        if qtype not in FLOAT_TYPES:
            block_format(qtype)  # names an unsupported type
        return data


def f32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07), i.e. the
    value the converter was given, so that arithmetic with it matches the original config's."""
    return float(str(np.float32(value)))


def single_value(value, key: str, source: Path):
    """A per-layer metadata array must be uniform here (we have no per-layer head counts)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConfigError(f"{source}: per-layer values for {key} ({value}) are not supported")
        return value[0]
    return value


def eos_ids(g: GGUFFile) -> list[int]:
    ids = (special_token_id(g, k) for k in ("eos", "eot", "eom"))
    return list(dict.fromkeys(i for i in ids if i is not None))


class GGUFTokenizer(Tokenizer):
    """Our Tokenizer over a fast tokenizer built from the GGUF's tokenizer.ggml.* metadata."""

    def __init__(self, g: GGUFFile):
        self.hf = build_hf_tokenizer(g)


def gguf_name(g: GGUFFile) -> str:
    return re.sub(r"\.gguf$", "", g.path.name, flags=re.IGNORECASE)
