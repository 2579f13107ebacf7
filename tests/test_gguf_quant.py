"""GGUF block formats: torch dequantization bit-exact with gguf-py, and the block-keeping Linear/Embedding."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashdraft.quant import (QUANT_FORMATS, QuantEmbedding, QuantLinear, UnsupportedQuantType, dequantize,
                              q4k_columns, q6k_lanes)
from flashdraft.quant.linear import gpu_matmul

# Byte offsets of each format's fp16 scales: random bytes there could be inf/NaN, so they get finite values.
FP16_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random rows of a GGUF type (finite scales), or of Q6_K_LANES / Q4_K_COLUMNS: random Q6_K rows in lane order,
    random Q4_K blocks super-block-major (rows a multiple of 256)."""
    if qtype == q4k_columns.QTYPE:
        gguf_rows = torch.from_numpy(random_blocks(q4k_columns.ROWS_QTYPE, rows, blocks_per_row, seed))
        return q4k_columns.from_rows(gguf_rows).numpy()
    if qtype == q6k_lanes.QTYPE:
        gguf_rows = torch.from_numpy(random_blocks(q6k_lanes.GGUF_QTYPE, rows, blocks_per_row, seed))
        return q6k_lanes.from_gguf(gguf_rows).numpy()
    fmt = QUANT_FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, fmt.block_bytes), dtype=np.uint8)
    for off in FP16_OFFSETS[qtype]:
        raw[:, off:off + 2] = rng.normal(0, 0.05, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks_per_row * fmt.block_bytes)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", list(QUANT_FORMATS))
def test_dequantize_is_bit_exact_with_gguf_py(qtype):
    blocks = random_blocks(qtype, rows=6, blocks_per_row=3)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    ours = dequantize(torch.from_numpy(blocks), qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape
    assert np.array_equal(_bits(ours.numpy()), _bits(ref))


# fp16 scale values at the edges of the format: zero and negative zero, the smallest subnormal, a subnormal, the
# smallest normal, one, the largest finite value, and their negatives (negative scales and negative mins).
EXTREME_F16 = np.array([0.0, -0.0, 2 ** -24, 3 * 2 ** -20, 2 ** -14, 1.0, 65504.0, -2 ** -24, -1.0, -65504.0],
                       dtype=np.float16)


@pytest.mark.parametrize("qtype", list(QUANT_FORMATS))
def test_dequantize_is_bit_exact_at_extreme_scales_and_codes(qtype):
    """Every pair of extreme fp16 values in the scale (and min) fields, over payloads of all-zero, all-one and
    random bits: the largest and smallest codes, 6-bit sub-block scales and mins at 0 and 63, the int8 Q6_K
    scales at -128 and 127."""
    fmt = QUANT_FORMATS[qtype]
    offsets = FP16_OFFSETS[qtype]
    pairs = [(a, b) for a in EXTREME_F16 for b in (EXTREME_F16 if len(offsets) > 1 else EXTREME_F16[:1])]
    rng = np.random.default_rng(7)
    payloads = [np.zeros(fmt.block_bytes, np.uint8), np.full(fmt.block_bytes, 0xFF, np.uint8),
                rng.integers(0, 256, fmt.block_bytes, dtype=np.uint8)]
    rows = []
    for payload in payloads:
        for pair in pairs:
            block = payload.copy()
            for off, value in zip(offsets, pair):
                block[off:off + 2] = np.array([value], np.float16).view(np.uint8)
            rows.append(block)
    blocks = np.stack(rows)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    ours = dequantize(torch.from_numpy(blocks), qtype).numpy()
    assert np.isfinite(ref).all() and np.array_equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize("qtype", list(QUANT_FORMATS))
def test_dequantize_keeps_leading_dimensions(qtype):
    """Stacked experts [E, rows, row_bytes] (Gemma 4 MoE keeps them in their blocks) decode row by row, as
    gguf-py decodes the same bytes flat."""
    fmt = QUANT_FORMATS[qtype]
    blocks = random_blocks(qtype, rows=3 * 4, blocks_per_row=2, seed=2).reshape(3, 4, 2 * fmt.block_bytes)
    ref = gguf.quants.dequantize(blocks.reshape(12, -1), gguf.GGMLQuantizationType[qtype]).reshape(3, 4, -1)
    ours = dequantize(torch.from_numpy(blocks), qtype)
    assert tuple(ours.shape) == (3, 4, 2 * fmt.block_elems)
    assert np.array_equal(_bits(ours.numpy()), _bits(ref))
    assert torch.equal(dequantize(torch.from_numpy(blocks)[1], qtype), ours[1])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantize_round_trips_gguf_py_quantization(qtype):
    w = np.random.default_rng(1).normal(0, 0.1, size=(16, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    ours = dequantize(torch.from_numpy(blocks), qtype).numpy()
    assert np.array_equal(_bits(ours), _bits(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])))
    assert np.abs(ours - w).max() < 0.1 * np.abs(w).max()


@pytest.mark.parametrize("qtype", list(QUANT_FORMATS))
def test_quant_linear_equals_linear_on_the_dequantized_weight(qtype):
    fmt = QUANT_FORMATS[qtype]
    blocks = torch.from_numpy(random_blocks(qtype, rows=24, blocks_per_row=2))
    k = 2 * fmt.block_elems
    bias = torch.randn(24)
    layer = QuantLinear(blocks, qtype, k, torch.float32, bias)
    x = torch.randn(5, k)
    w = dequantize(blocks, qtype)
    assert torch.equal(layer(x), F.linear(x, w, bias))
    assert torch.equal(layer.weight, w) and layer.blocks.dtype == torch.uint8
    emb = QuantEmbedding(blocks, qtype, k, torch.float32)
    tokens = torch.tensor([3, 0, 23, 3])
    assert torch.equal(emb(tokens), w[tokens])


def test_cpu_has_no_gpu_kernel():
    assert gpu_matmul("Q4_K", torch.device("cpu")) is None


def test_compiled_layers_trace_the_kernel_lookup_without_a_warning():
    """Compiled layers trace QuantLinear's kernel lookup; through a functools cache it made dynamo warn in every
    GPU run's log (a possible silent error, it said)."""
    import warnings

    def f(x):
        return x * (2 if gpu_matmul("Q4_K", torch.device("cuda")) is not None else 3)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.compile(f, fullgraph=True)(torch.ones(2)).shape == (2,)
    torch._dynamo.reset()
    assert not [w for w in caught if "cache" in str(w.message)], [str(w.message)[:100] for w in caught]


def test_bad_blocks_and_types_are_named():
    with pytest.raises(UnsupportedQuantType, match="IQ4_XS"):
        dequantize(torch.zeros(2, 136, dtype=torch.uint8), "IQ4_XS")
    with pytest.raises(ValueError, match="not a whole number of 34-byte blocks"):
        dequantize(torch.zeros(2, 35, dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match=r"Q8_0 blocks must be uint8 \[4, 68\]"):
        QuantLinear(torch.zeros(4, 34, dtype=torch.uint8), "Q8_0", 64, torch.float32)
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        QuantLinear(torch.zeros(4, 144, dtype=torch.uint8), "Q4_K", 128, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need CUDA")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_triton_kernel_matches_dequantized_matmul_and_is_batch_invariant(qtype):
    pytest.importorskip("triton")
    from flashdraft.quant.gpu_kernels import KERNELS

    fmt = QUANT_FORMATS[qtype]
    n, k = 200, 512  # n is not a multiple of the N-tile, so the edge masking runs too
    layer = QuantLinear(torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=k // fmt.block_elems)).cuda(),
                        qtype, k, torch.bfloat16)
    blocks = layer.blocks  # Q6_K: in lane order
    w = dequantize(blocks, layer.qtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, k, device="cuda", generator=g)
    kernel = KERNELS[layer.qtype]
    ref = x.double() @ w.double().T
    exact = kernel(x, blocks, n)
    assert ((exact.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    xb = x.bfloat16()
    ref_b = xb.double() @ w.bfloat16().double().T
    y16 = kernel(xb, blocks, n)
    assert ((y16.double() - ref_b).abs().max() / ref_b.abs().max()).item() < 1e-2
    for m in (1, 2, 4, 8):
        assert torch.equal(kernel(xb[:m], blocks, n), y16[:m])
    assert gpu_matmul(layer.qtype, blocks.device) is kernel and torch.equal(layer(xb), y16)
