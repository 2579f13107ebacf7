"""Q6_K rows in lane order (flashdraft.quant.q6k_lanes): the layout its docstring states, byte for byte; the same
weights as gguf-py's; and the modules that keep Q6_K weights keep them so."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashdraft.quant import QuantEmbedding, QuantLinear, dequantize, q6k_lanes
from test_gguf_quant import random_blocks


def _layout_by_hand(gguf_rows: np.ndarray) -> np.ndarray:
    """The lane-order rows, written from the docstring's rules one byte at a time."""
    rows, nbytes = gguf_rows.shape
    nsb = nbytes // 210
    out = np.zeros((rows, q6k_lanes.row_bytes(256 * nsb)), np.uint8)
    for sb in range(nsb):
        src, dst = gguf_rows[:, 210 * sb:210 * sb + 210], out[:, 208 * sb:208 * sb + 208]
        for o in range(128):  # ql byte 64n + 32h + 16g + 4c + b -> 64h + 16c + 8n + 4g + b
            n, h, g, c, b = o // 64, o // 32 % 2, o // 16 % 2, o // 4 % 4, o % 4
            dst[:, 64 * h + 16 * c + 8 * n + 4 * g + b] = src[:, o]
        for o in range(64):  # qh byte 128 + 32n + 16g + 4c + b -> 128 + 16c + 8n + 4g + b
            n, g, c, b = o // 32, o // 16 % 2, o // 4 % 4, o % 4
            dst[:, 128 + 16 * c + 8 * n + 4 * g + b] = src[:, 128 + o]
        dst[:, 192:208] = src[:, 192:208]
        out[:, 208 * nsb + 2 * sb:208 * nsb + 2 * sb + 2] = src[:, 208:210]
    return out


@pytest.mark.parametrize("nsb", [1, 2, 8, 21])
def test_rows_are_laid_out_as_documented_and_come_back(nsb):
    """1 and 21 super-blocks: rows padded to 16 bytes (224, 4416); 8: 1680 bytes, no padding."""
    rows = random_blocks("Q6_K", rows=5, blocks_per_row=nsb, seed=nsb)
    lanes = q6k_lanes.from_gguf(torch.from_numpy(rows))
    assert lanes.dtype == torch.uint8 and lanes.shape == (5, q6k_lanes.row_bytes(256 * nsb))
    assert lanes.shape[1] % 16 == 0 and lanes.shape[1] - 210 * nsb < 16
    assert np.array_equal(lanes.numpy(), _layout_by_hand(rows))
    assert torch.equal(q6k_lanes.to_gguf(lanes), torch.from_numpy(rows))
    assert q6k_lanes.super_blocks(lanes.shape[1]) == nsb


def test_the_weights_are_gguf_pys_bit_for_bit():
    """Leading dimensions (stacked rows) decode row by row, as the GGUF bytes do in gguf-py."""
    rows = random_blocks("Q6_K", rows=12, blocks_per_row=3, seed=9)
    ref = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q6_K)
    lanes = q6k_lanes.from_gguf(torch.from_numpy(rows).reshape(3, 4, -1))
    ours = dequantize(lanes, q6k_lanes.QTYPE)
    assert ours.shape == (3, 4, 768)
    assert np.array_equal(ours.reshape(12, -1).numpy().view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_modules_keep_q6_k_in_lane_order():
    """QuantLinear and QuantEmbedding given the file's Q6_K bytes keep lane-order rows (type Q6_K_LANES) and
    compute with gguf-py's weights; given lane-order rows, they keep those very rows (fused projections and a tied
    LM head pass them on)."""
    rows = random_blocks("Q6_K", rows=24, blocks_per_row=2, seed=1)
    w = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q6_K))
    layer = QuantLinear(torch.from_numpy(rows), "Q6_K", 512, torch.float32)
    assert layer.qtype == q6k_lanes.QTYPE and torch.equal(layer.blocks, q6k_lanes.from_gguf(torch.from_numpy(rows)))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer.weight, w) and torch.equal(layer(x), F.linear(x, w))
    emb = QuantEmbedding(torch.from_numpy(rows), "Q6_K", 512, torch.float32)
    tokens = torch.tensor([[3, 0, 23], [7, 7, 1]])
    assert emb.qtype == q6k_lanes.QTYPE and torch.equal(emb(tokens), w[tokens])
    again = QuantLinear(emb.blocks, emb.qtype, 512, torch.float32)
    assert again.blocks.data_ptr() == emb.blocks.data_ptr() and torch.equal(again.weight, w)


def test_wrong_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"Q6_K rows must be uint8 \[\.\.\., a multiple of 210\]"):
        q6k_lanes.from_gguf(torch.zeros(2, 200, dtype=torch.uint8))
    with pytest.raises(ValueError, match="Q6_K_LANES: 230 bytes is not the row size of any row length"):
        q6k_lanes.to_gguf(torch.zeros(2, 230, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"Q6_K_LANES blocks must be uint8 \[4, 432\]"):
        QuantLinear(torch.zeros(4, 420, dtype=torch.uint8), "Q6_K_LANES", 512, torch.float32)
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        q6k_lanes.row_bytes(300)
