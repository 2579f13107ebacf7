"""GGML blocks -> float32 weights in torch, bit-exact with gguf-py's numpy `gguf.quants.dequantize`.

Each decoder takes blocks as uint8 [n_blocks, block_bytes] and returns float32 [n_blocks, block_elems].
The arithmetic (which products are formed first, float32 throughout) follows gguf-py operation by
operation, so the results agree bit for bit; the layouts are those of ggml-common.h.
"""
from __future__ import annotations

import torch

from flashdraft.quant import q4k_columns, q6k_lanes
from flashdraft.quant.formats import block_format


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row holding an fp16 scale -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _shifts(*values: int, shape: tuple[int, ...], device) -> torch.Tensor:
    """Shift amounts 0, s, 2s, ... made on the device by arange (torch.tensor would copy from the host, which a
    CUDA graph capture forbids: a QuantEmbedding lookup runs inside the engine's graphs)."""
    step = values[1] - values[0]
    assert values == tuple(step * i for i in range(len(values)))
    return (torch.arange(len(values), dtype=torch.uint8, device=device) * step).view(shape)


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """Legacy 32-weight blocks: 16 bytes, low nibbles are weights 0-15, high nibbles 16-31 -> [n, 32]."""
    n = qs.shape[0]
    return ((qs.view(n, 1, 16) >> _shifts(0, 4, shape=(1, 2, 1), device=qs.device)) & 0x0F).reshape(n, 32)


def _bits_32(qh: torch.Tensor) -> torch.Tensor:
    """Four bytes read as a little-endian uint32; bit i belongs to weight i -> [n, 32] of 0/1."""
    n = qh.shape[0]
    return ((qh.view(n, 4, 1) >> torch.arange(8, dtype=torch.uint8, device=qh.device).view(1, 1, 8)) & 1).reshape(n, 32)


def _q4_0(b):
    d = _f16(b[:, 0:2])
    q = _nibbles_32(b[:, 2:18]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return d * _nibbles_32(b[:, 4:20]).float() + m


def _q5_0(b):
    d = _f16(b[:, 0:2])
    q = (_nibbles_32(b[:, 6:22]) | (_bits_32(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles_32(b[:, 8:24]) | (_bits_32(b[:, 4:8]) << 4)
    return d * q.float() + m


def _q8_0(b):
    d = _f16(b[:, 0:2])
    return b[:, 2:34].contiguous().view(torch.int8).float() * d


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 6-bit scales and mins, [n, 8] each.

    Bytes 0-3: scales 0-3 in the low 6 bits, top 2 bits of scales 4-7; bytes 4-7: the same for the mins;
    bytes 8-11: low nibble = low 4 bits of scales 4-7, high nibble = low 4 bits of mins 4-7.
    """
    n = s.shape[0]
    s = s.reshape(n, 3, 4)
    sc_lo, mn_lo, hi = s[:, 0], s[:, 1], s[:, 2]
    scales = torch.cat([sc_lo & 0x3F, (hi & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=-1)
    mins = torch.cat([mn_lo & 0x3F, (hi >> 4) | ((mn_lo >> 2) & 0x30)], dim=-1)
    return scales, mins


def _nibbles_k(qs: torch.Tensor) -> torch.Tensor:
    """K-quant nibbles: 128 bytes; byte 32g+i holds weight 64g+i (low) and 64g+32+i (high) -> [n, 8, 32]."""
    n = qs.shape[0]
    return ((qs.view(n, 4, 1, 32) >> _shifts(0, 4, shape=(1, 1, 2, 1), device=qs.device)) & 0x0F).reshape(n, 8, 32)


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: weight = (d * scale_j) * q - (dmin * min_j) per 32-weight sub-block j."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scales, mins = _k_scales_mins(b[:, 4:16])
    dl = (d * scales.float()).view(n, 8, 1)
    ml = (dmin * mins.float()).view(n, 8, 1)
    return (dl * q.float() - ml).reshape(n, 256)


def _q4_k(b):
    return _k_affine(b, _nibbles_k(b[:, 16:144]))


def _q5_k(b):
    n = b.shape[0]
    high = (b[:, 16:48].view(n, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 1, 8, 1)) & 1
    return _k_affine(b, _nibbles_k(b[:, 48:176]) | (high.reshape(n, 8, 32) << 4))


def _q6_k(b):
    """Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d; weight = d*s_j*(q-32)."""
    n = b.shape[0]
    ql = (b[:, 0:128].reshape(n, 2, 1, 64) >> _shifts(0, 4, shape=(1, 1, 2, 1), device=b.device)) & 0x0F
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1), device=b.device)) & 0x03
    q = (ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).view(n, 16, 1)
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 [..., row_bytes] of `qtype` blocks -> float32 [..., row_elems] (each row decoded independently);
    Q6_K_LANES rows and Q4_K_COLUMNS blocks (2-D) are put back in GGUF's order first."""
    if qtype == q6k_lanes.QTYPE:
        return dequantize(q6k_lanes.to_gguf(blocks), q6k_lanes.GGUF_QTYPE)
    if qtype == q4k_columns.QTYPE:
        return dequantize(q4k_columns.to_rows(blocks), q4k_columns.ROWS_QTYPE)
    fmt = block_format(qtype)
    if blocks.dtype != torch.uint8:
        raise TypeError(f"{qtype} blocks must be uint8, got {blocks.dtype}")
    lead, row_bytes = blocks.shape[:-1], blocks.shape[-1]
    if row_bytes % fmt.block_bytes:
        raise ValueError(f"{qtype}: {row_bytes} bytes per row is not a whole number of {fmt.block_bytes}-byte blocks")
    flat = blocks.reshape(-1, fmt.block_bytes)
    return _DECODERS[qtype](flat).reshape(*lead, row_bytes // fmt.block_bytes * fmt.block_elems)
