import copy

import torch

from flashdraft.config import ModelConfig
from flashdraft.quant.kv_formats import bytes_per_token, cache_format, new_rows


class KVCache:
    """Preallocated keys and values, one [kv_heads, capacity, row] pair per layer.

    The cache holds no length of its own: the owner of a sequence knows how many rows are valid, and
    attention masks by position. Rolling back to any earlier length is therefore just a smaller
    length on the owner's side: O(1), nothing copied or cleared.

    k_type / v_type are KV cache types (flashdraft.quant.kv_formats: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1,
    q4_0); None keeps the compute dtype. A row is head_dim values of that dtype or a packed uint8 row of blocks,
    which attention quantizes on write and dequantizes on read.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, device: torch.device, dtype: torch.dtype,
                 k_type: str | None = None, v_type: str | None = None):
        self.capacity = capacity
        self.k_format, self.v_format = cache_format(k_type, dtype), cache_format(v_type, dtype)
        heads, hd, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
        self.layer_shapes = [(heads, hd)] * layers
        self.k = [new_rows(self.k_format, heads, capacity, hd, device) for _ in range(layers)]
        self.v = [new_rows(self.v_format, heads, capacity, hd, device) for _ in range(layers)]

    def reusable(self, rows: int) -> int:
        """How many of the first `rows` positions a new sequence that shares them can keep: all of them, since
        rows are stored at their absolute positions and nothing past the owner's length overwrites them."""
        return rows

    def copy_prefix(self, source: "KVCache", rows: int) -> None:
        """Take positions [0, rows) from another sequence's cache (one that shares those tokens and cache types)."""
        check_same_types(self, source)
        for dst, src in zip(self.k + self.v, source.k + source.v):
            dst[:, :rows].copy_(src[:, :rows])

    def snapshot(self, rows: int, device: torch.device | str = "cpu") -> "KVCache":
        """A copy of positions [0, rows) on `device`, holding only those rows: the host prompt cache keeps
        evicted prefixes so, and copy_prefix takes one as its source to bring them back."""
        snap = copy.copy(self)
        snap.capacity = rows
        snap.k = [t[:, :rows].to(device, copy=True) for t in self.k]
        snap.v = [t[:, :rows].to(device, copy=True) for t in self.v]
        return snap

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_per_token(self) -> int:
        """Cache bytes each position of context takes (all layers, keys and values)."""
        return bytes_per_token(self.layer_shapes, self.k_format, self.v_format)


def check_same_types(cache, source) -> None:
    """Rows copied between caches must be stored alike (a copy would otherwise cast or fail on the row width)."""
    if (cache.k_format, cache.v_format) != (source.k_format, source.v_format):
        raise ValueError(f"cannot copy a prefix from a {source.k_format.name}/{source.v_format.name} cache into a "
                         f"{cache.k_format.name}/{cache.v_format.name} one")
