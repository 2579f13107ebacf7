"""Q4_K blocks super-block-major in chunks of 256 rows (flashdraft.quant.q4k_columns, Q4_K_COLUMNS): where each byte
goes, dequantization bit-exact with gguf-py, which projections a QuantLinear keeps so, and that fused projections,
their parts and a slice of their rows stay views of one layout. The CUDA kernel's products on it: test_mma_kernels."""
import gguf
import numpy as np
import pytest
import torch

from flashdraft.quant import QuantEmbedding, QuantLinear, dequantize, q4k_columns
from test_gguf_quant import random_blocks

CHUNK = q4k_columns.CHUNK_ROWS


def _rows(n: int, nsb: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks("Q4_K", rows=n, blocks_per_row=nsb, seed=seed))


def test_each_byte_goes_to_its_chunk_super_block_and_row_and_back():
    n, nsb = 2 * CHUNK, 3
    rows = _rows(n, nsb)
    cols = q4k_columns.from_rows(rows)
    assert cols.shape == rows.shape and not torch.equal(cols, rows)
    flat = cols.reshape(-1)
    for r, sb, b in ((0, 0, 0), (5, 2, 17), (CHUNK - 1, 1, 143), (CHUNK, 0, 3), (n - 1, 2, 100)):
        at = (r // CHUNK) * CHUNK * nsb * 144 + (sb * CHUNK + r % CHUNK) * 144 + b
        assert flat[at] == rows[r, sb * 144 + b], (r, sb, b)
    assert torch.equal(q4k_columns.to_rows(cols), rows)


def test_dequantized_weights_are_gguf_py_s_bit_for_bit():
    rows = _rows(CHUNK, 2, seed=1)
    ref = gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType.Q4_K)
    ours = dequantize(q4k_columns.from_rows(rows), q4k_columns.QTYPE)
    assert np.array_equal(ours.numpy().view(np.uint32), np.ascontiguousarray(ref, dtype=np.float32).view(np.uint32))


def test_blocks_that_are_not_whole_chunks_are_refused_by_name():
    with pytest.raises(ValueError, match="multiple of 256"):
        q4k_columns.from_rows(_rows(100, 1))
    with pytest.raises(ValueError, match="Q4_K_COLUMNS blocks"):
        q4k_columns.to_rows(torch.zeros(CHUNK, 145, dtype=torch.uint8))
    with pytest.raises(ValueError, match="chunks of 256 rows, got 100 rows"):
        QuantLinear(_rows(100, 1), q4k_columns.QTYPE, 256, torch.float32)
    with pytest.raises(ValueError, match=r"looks its rows up one by one.*\(Q4_K\), not Q4_K_COLUMNS"):
        QuantEmbedding(q4k_columns.from_rows(_rows(CHUNK, 1)), q4k_columns.QTYPE, 256, torch.float32)


def test_quant_linear_keeps_whole_chunks_super_block_major_and_computes_the_same_product():
    """by_columns (the loader's projections) re-lays whole chunks out; without it the blocks are kept as given."""
    rows = _rows(CHUNK, 2, seed=2)
    kept = QuantLinear(rows, "Q4_K", 512, torch.float32, by_columns=True)
    in_order = QuantLinear(rows, "Q4_K", 512, torch.float32)
    assert kept.qtype == q4k_columns.QTYPE and in_order.qtype == "Q4_K"
    assert torch.equal(kept.blocks, q4k_columns.from_rows(rows)) and torch.equal(in_order.blocks, rows)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kept(x), in_order(x))
    assert in_order.blocks is rows
    odd = QuantLinear(_rows(CHUNK + 16, 2), "Q4_K", 512, torch.float32, by_columns=True)  # not whole chunks
    assert odd.qtype == "Q4_K"


def _kv_rows_of(fused: QuantLinear, q_rows: int) -> QuantLinear:
    """The drafter's [k; v] projection of an attention whose fused q/k/v is `fused` (llama.model._kv_rows)."""
    from types import SimpleNamespace

    from flashdraft.models.llama.model import _kv_rows

    return _kv_rows(SimpleNamespace(qkv_proj=fused, q_proj=SimpleNamespace(out_features=q_rows)))


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_fused_parts_and_a_slice_of_their_rows_stay_views_of_one_layout():
    """torch.cat of whole-chunk parts is the fused weight in the same layout, each part's blocks become a view of
    it (skinny_gemm.fuse_rows), and rows cut at a chunk boundary (a drafter's [k; v] rows) are a projection too."""
    from flashdraft.layers.skinny_gemm import fuse_rows

    parts = [QuantLinear(_rows(n, 2, seed=s), "Q4_K", 512, torch.float32, by_columns=True)
             for s, n in ((3, 2 * CHUNK), (4, CHUNK), (5, CHUNK))]
    weights = [p.weight.clone() for p in parts]
    fused = fuse_rows(parts)
    assert fused.qtype == q4k_columns.QTYPE and fused.out_features == 4 * CHUNK
    assert torch.equal(fused.weight, torch.cat(weights))
    for p, w in zip(parts, weights):
        assert _shares(p.blocks, fused.blocks)
        assert torch.equal(p.weight, w)
    kv = _kv_rows_of(fused, 2 * CHUNK)
    assert kv.qtype == q4k_columns.QTYPE and _shares(kv.blocks, fused.blocks)
    assert torch.equal(kv.weight, torch.cat(weights[1:]))


def test_an_embedding_and_its_tied_lm_head_keep_gguf_order_and_share_the_blocks():
    from types import SimpleNamespace

    from flashdraft.models.gguf import tie_lm_head

    emb = QuantEmbedding(_rows(CHUNK, 2, seed=6), "Q4_K", 512, torch.float32)
    model = SimpleNamespace(model=SimpleNamespace(embed_tokens=emb), lm_head=None)
    tie_lm_head(model, 512, torch.float32)
    assert emb.qtype == model.lm_head.qtype == "Q4_K" and model.lm_head.blocks is emb.blocks
    assert torch.equal(emb(torch.tensor([7])), model.lm_head.weight[7:8])


def test_parts_of_whole_chunks_and_others_fuse_in_gguf_order():
    """A q of whole chunks (super-block-major) and k / v that are not (GGUF's order) are still one product: the
    fused weight in GGUF's order, the parts views of it of its type, every weight as before."""
    from flashdraft.layers.skinny_gemm import fuse_rows

    parts = [QuantLinear(_rows(n, 2, seed=s), "Q4_K", 512, torch.float32, by_columns=True)
             for s, n in ((8, CHUNK), (9, 128), (10, 128))]
    assert [p.qtype for p in parts] == [q4k_columns.QTYPE, "Q4_K", "Q4_K"]
    weights = [p.weight.clone() for p in parts]
    fused = fuse_rows(parts)
    assert fused.qtype == "Q4_K" and all(p.qtype == "Q4_K" for p in parts)
    assert torch.equal(fused.weight, torch.cat(weights))
    assert all(torch.equal(p.weight, w) for p, w in zip(parts, weights))
    assert parts[1].blocks.data_ptr() == fused.blocks[CHUNK:].data_ptr()
    kv = _kv_rows_of(fused, CHUNK)  # [k; v]: 256 rows in GGUF's order, kept so (a view, not a copy re-laid out)
    assert kv.qtype == "Q4_K" and kv.blocks.data_ptr() == fused.blocks[CHUNK:].data_ptr()
    assert torch.equal(kv.weight, torch.cat(weights[1:]))
