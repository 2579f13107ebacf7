import torch

from flashdraft.config import ModelConfig


class KVCache:
    """Preallocated keys and values, one [kv_heads, capacity, head_dim] pair per layer.

    The cache holds no length of its own: the owner of a sequence knows how many rows are valid, and
    attention masks by position. Rolling back to any earlier length is therefore just a smaller
    length on the owner's side: O(1), nothing copied or cleared.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, device: torch.device, dtype: torch.dtype):
        shape = (cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.capacity = capacity
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]

    def reusable(self, rows: int) -> int:
        """How many of the first `rows` positions a new sequence that shares them can keep: all of them, since
        rows are stored at their absolute positions and nothing past the owner's length overwrites them."""
        return rows

    def copy_prefix(self, source: "KVCache", rows: int) -> None:
        """Take positions [0, rows) from another sequence's cache (one that shares those tokens)."""
        for dst, src in zip(self.k + self.v, source.k + source.v):
            dst[:, :rows].copy_(src[:, :rows])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
