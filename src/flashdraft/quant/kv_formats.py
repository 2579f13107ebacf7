"""KV cache types (llama.cpp's -ctk / -ctv): how rows of keys or values are stored, written and read back.

A cache row (one position of one kv head, head_dim values) is stored either as floats (f32, f16, bf16) or in
one of llama.cpp's block types (q8_0, q5_1, q5_0, q4_1, q4_0): 32-value blocks along head_dim with fp16 scales,
head_dim / 32 * block_bytes bytes a row, as llama.cpp stores them. Quantization follows gguf-py's `gguf.quants`
(which reproduces llama.cpp's quantize_row_*_ref) operation by operation in float32, so every block holds the
values llama.cpp would store, and dequantization computes them as gguf-py does (float32, then rounded once to
the compute dtype).

The bytes of a row are laid out by field, not block by block as in ggml-common.h: the quants of all its blocks
first (q8_0: one int8 a value; 4- and 5-bit types: one byte per two values, value 2i in the low nibble of byte
i and 2i + 1 in the high one), then the 5-bit types' high bits (bit t of byte b is bit 4 of value 8b + t: the
blocks' 4-byte fields one after another), then the blocks' fp16 scales d, then the affine types' fp16 minimums m.
The attention kernel then reads a row's quants with wide loads and each block's scale once, where llama.cpp's
34-, 18- and 22-byte blocks leave the quants unaligned and interleaved with the scales (on the H200 that layout
made a q8_0 cache half as fast as bf16 at 32K tokens: docs/performance.md).

A cache tensor says its own type: a float tensor holds values in its dtype, and a uint8 one holds blocks whose
size is its row width over head_dim / 32 (the block sizes 18, 20, 22, 24 and 34 bytes are distinct). So the
layers take plain tensors (slices, ring rows, copies of a prefix all work as for any tensor), and every row is
quantized by itself: a token's stored bits never depend on what else was written with it (batch invariance).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.quant.formats import block_format

BLOCK = 32  # values per block of every quantized cache type


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype  # the cache tensor's dtype: the float type itself, or uint8 for blocks
    block_bytes: int      # bytes per 32 values

    @property
    def blocked(self) -> bool:
        return self.storage == torch.uint8

    @property
    def bits_per_value(self) -> float:
        return self.block_bytes * 8 / BLOCK

    def row_width(self, head_dim: int) -> int:
        """Elements of the storage dtype per cache row of head_dim values."""
        if self.blocked and head_dim % BLOCK:
            raise ValueError(f"cache type {self.name} needs a head_dim that is a multiple of {BLOCK}, "
                             f"got {head_dim}")
        return head_dim // BLOCK * self.block_bytes if self.blocked else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.storage.itemsize


FLOAT_FORMATS = {f.name: f for f in (KVFormat("f32", torch.float32, 128), KVFormat("f16", torch.float16, 64),
                                     KVFormat("bf16", torch.bfloat16, 64))}
BLOCK_FORMATS = {name: KVFormat(name, torch.uint8, block_format(name.upper()).block_bytes)
                 for name in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")}
KV_FORMATS = {**FLOAT_FORMATS, **BLOCK_FORMATS}
# The kernels' codes for the block types (kernels.attention_triton reads rows of them, kernels.qkv_prep_triton
# writes them); float rows of any dtype are 0.
KERNEL_FORMATS = {"q8_0": 1, "q4_0": 2, "q4_1": 3, "q5_0": 4, "q5_1": 5}
_BY_DTYPE = {f.storage: f for f in FLOAT_FORMATS.values()}
_BY_BLOCK_BYTES = {f.block_bytes: f for f in BLOCK_FORMATS.values()}


def kv_format(name: str) -> KVFormat:
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV cache type {name!r}; supported: {', '.join(KV_FORMATS)}") from None


def cache_format(name: str | None, dtype: torch.dtype) -> KVFormat:
    """The format a cache of compute dtype `dtype` uses for cache type `name` (None: the compute dtype)."""
    if name is None:
        if dtype not in _BY_DTYPE:
            raise ValueError(f"no KV cache type for dtype {dtype}")
        return _BY_DTYPE[dtype]
    return kv_format(name)


def new_rows(fmt: KVFormat, kv_heads: int, rows: int, head_dim: int, device) -> torch.Tensor:
    """Zeroed storage for `rows` cache rows of one layer: [kv_heads, rows, row_width]."""
    return torch.zeros((kv_heads, rows, fmt.row_width(head_dim)), device=device, dtype=fmt.storage)


def stored_format(stored: torch.Tensor, head_dim: int) -> KVFormat:
    """The format of a cache tensor whose rows hold head_dim values (module docstring)."""
    if stored.dtype in _BY_DTYPE:
        if stored.shape[-1] != head_dim:
            raise ValueError(f"a {stored.dtype} cache row of width {stored.shape[-1]} does not hold {head_dim} values")
        return _BY_DTYPE[stored.dtype]
    if stored.dtype == torch.uint8 and head_dim % BLOCK == 0 and stored.shape[-1] % (head_dim // BLOCK) == 0:
        fmt = _BY_BLOCK_BYTES.get(stored.shape[-1] // (head_dim // BLOCK))
        if fmt is not None:
            return fmt
    raise ValueError(f"a {stored.dtype} cache row of width {stored.shape[-1]} is no KV cache type's row of "
                     f"{head_dim} values")


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., n, 1] -> their fp16 bytes [..., 2n] (round to nearest even, as GGML_FP32_TO_FP16), low byte
    first. The bytes come from the int16 bits by shifts, not from a view as uint8: compiled, such a view needs a
    unit last stride, which Inductor need not give a computed [..., n, 1] (a Gemma 4 layer with a q5_0 cache
    failed to compile on the H200)."""
    bits = x.squeeze(-1).to(torch.float16).view(torch.int16).to(torch.int32)
    return torch.stack([bits & 0xFF, (bits >> 8) & 0xFF], dim=-1).to(torch.uint8).flatten(-2)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, 0.0, 1.0 / d)


def _divided(x: torch.Tensor, n: int) -> torch.Tensor:
    """x / n rounded once, as llama.cpp's C division: on CUDA, torch divides by a Python number as a product with
    its rounded reciprocal, which can differ by an ulp, so the divisor is a tensor on x's device (filled there:
    no copy from the host, which would wait for the stream and cannot be captured in a CUDA graph)."""
    return x / torch.full((), n, dtype=x.dtype, device=x.device)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] of 0..31 -> [..., head_dim / 2] bytes: value 2i's low 4 bits in the low half of byte i,
    value 2i + 1's in the high half."""
    return (q[..., 0::2] & 0x0F) | ((q[..., 1::2] & 0x0F) << 4)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] of 0..31 -> [..., head_dim / 8] bytes, bit t of byte b = bit 4 of value 8b + t."""
    bits = ((q >> 4) & 1).unflatten(-1, (-1, 8))
    return (bits << torch.arange(8, device=q.device, dtype=q.dtype)).sum(-1)


def _truncated(x: torch.Tensor, high: int) -> torch.Tensor:
    """trunc(x) clipped to [0, high] as int32 (llama.cpp's MIN(high, (int8_t)(x)); x is never below 0 here)."""
    return torch.trunc(x).clamp(0, high).to(torch.int32)


def _symmetric(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0 / q5_0: d = (the value of largest magnitude, first if tied) / -levels, q = trunc(x / d + levels + 0.5)."""
    peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    d = _divided(peak, -levels)
    return d, _truncated(x * _inverse(d) + (levels + 0.5), 2 * levels - 1)


def _affine(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_1 / q5_1: m = min, d = (max - min) / levels, q = trunc((x - m) / d + 0.5)."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = _divided(hi - lo, levels)
    return d, lo, _truncated((x - lo) * _inverse(d) + 0.5, levels)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero) as gguf-py writes it, exact where floor(|x| + 0.5) is not."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _quantize_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """float32 [..., n, 32] (a row's blocks) -> uint8 [..., row_width] in the layout of the module docstring."""
    if name == "q8_0":
        d = _divided(x.abs().amax(-1, keepdim=True), 127)
        q = _roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([q.flatten(-2), _f16_bytes(d)], dim=-1)
    if name in ("q4_0", "q5_0"):
        d, q = _symmetric(x, 8 if name == "q4_0" else 16)
        scales = [_f16_bytes(d)]
    else:
        d, m, q = _affine(x, 15 if name == "q4_1" else 31)
        scales = [_f16_bytes(d), _f16_bytes(m)]
    q = q.flatten(-2)
    fields = [_pack_nibbles(q)] + ([_pack_high_bits(q)] if name in ("q5_0", "q5_1") else [])
    return torch.cat([f.to(torch.uint8) for f in fields] + scales, dim=-1)


def quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows [..., head_dim] -> storage [..., row_width] in format fmt (float types: a cast)."""
    if not fmt.blocked:
        return x.to(fmt.storage)
    fmt.row_width(x.shape[-1])  # head_dim check
    return _quantize_rows(x.float().unflatten(-1, (-1, BLOCK)), fmt.name)


def _f16_at(stored: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """The n fp16 values at byte `start` of every row -> float32 [..., n, 1]."""
    return stored[..., start:start + 2 * n].contiguous().view(torch.float16).float().unsqueeze(-1)


def dequantize_rows(stored: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """Storage [..., row_width] in format fmt -> rows [..., head_dim] of dtype (blocks: float32 values computed as
    gguf-py's dequantize does, rounded once to dtype)."""
    if not fmt.blocked:
        return stored.to(dtype)
    nb = stored.shape[-1] // fmt.block_bytes
    head_dim = nb * BLOCK
    if fmt.name == "q8_0":
        q = stored[..., :head_dim].contiguous().view(torch.int8).float().unflatten(-1, (nb, BLOCK))
        return (q * _f16_at(stored, head_dim, nb)).flatten(-2).to(dtype)
    nibbles = stored[..., :head_dim // 2]
    q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).flatten(-2)
    at = head_dim // 2
    if fmt.name in ("q5_0", "q5_1"):
        high = stored[..., at:at + head_dim // 8]
        shifts = torch.arange(8, dtype=torch.uint8, device=stored.device)
        q = q | (((high.unsqueeze(-1) >> shifts) & 1) << 4).flatten(-2)
        at += head_dim // 8
    q = q.unflatten(-1, (nb, BLOCK))
    d = _f16_at(stored, at, nb)
    if fmt.name == "q4_0":
        x = d * (q.to(torch.int8) - 8).float()
    elif fmt.name == "q5_0":
        x = d * (q.to(torch.int8) - 16).float()
    else:
        x = d * q.float() + _f16_at(stored, at + 2 * nb, nb)
    return x.flatten(-2).to(dtype)


def write_rows(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[:, index[t]] = rows[:, t] in the cache's own format (cache [kv_heads, capacity, width], rows
    [kv_heads, T, head_dim], index [T])."""
    if cache.dtype != rows.dtype:
        rows = quantize(rows, stored_format(cache, rows.shape[-1]))
    cache.index_copy_(1, index, rows)


def read_rows(cache: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., width] as values [..., head_dim] of dtype (the tensor itself when it already is that)."""
    if cache.dtype == dtype:
        return cache
    return dequantize_rows(cache, stored_format(cache, head_dim), dtype)


def as_stored(rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """rows [..., head_dim] as they read back once written to `cache` (quantized and dequantized): attention over
    rows not yet written must see what a later step reads from the cache."""
    if cache.dtype == rows.dtype:
        return rows
    fmt = stored_format(cache, rows.shape[-1])
    return dequantize_rows(quantize(rows, fmt), fmt, rows.dtype)


def bytes_per_token(layers: list[tuple[int, int]], k: KVFormat, v: KVFormat) -> int:
    """Cache bytes one position takes over layers given as (kv_heads, head_dim)."""
    return sum(heads * (k.row_bytes(hd) + v.row_bytes(hd)) for heads, hd in layers)
