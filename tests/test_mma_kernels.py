"""The CUDA tensor-core k-quant kernel (flashdraft.quant.mma_kernels; Q4_K, Q5_K, Q6_K in lane order): which products
it takes, its tilings, and on a GPU its results (against dequantize + matmul in float64) and bitwise batch invariance
over every M <= 16."""
import pytest
import torch

from flashdraft.quant import dequantize, mma_kernels, q4k_columns
from flashdraft.quant.mma_kernels import MAX_SPLIT, MmaTiling, default_tiling, tilings_for
from test_gguf_quant import random_blocks


def _rows(qtype: str, rows: int) -> int:
    """rows, or for super-block-major Q4_K the next whole number of its chunks of rows."""
    return -(-rows // q4k_columns.CHUNK_ROWS) * q4k_columns.CHUNK_ROWS if qtype == q4k_columns.QTYPE else rows


def test_products_off_the_gpu_are_not_taken():
    x = torch.zeros(2, 512, dtype=torch.bfloat16)
    assert not mma_kernels.supported(x, torch.zeros(32, 288, dtype=torch.uint8), 32, "Q4_K")


def test_types_without_the_kernel_are_not_taken():
    x = torch.zeros(2, 512, dtype=torch.bfloat16)
    assert not mma_kernels.supported(x, torch.zeros(32, 68, dtype=torch.uint8), 32, "Q8_0")


@pytest.mark.parametrize("n,k", [(21504, 5376), (5376, 21504), (4096, 4096), (1024, 2816), (16, 256), (151936, 4096)])
def test_default_tiling_splits_k_evenly_and_fills_the_gpu(n, k):
    t = default_tiling(n, k, sms=132)
    nsb = k // 256
    assert nsb % t.split == 0 and 1 <= t.split <= MAX_SPLIT
    blocks = -(-n // (16 * t.r_tiles * t.warps))
    smaller = [d for d in range(1, t.split) if nsb % d == 0]
    if blocks * t.split >= mma_kernels.BLOCKS_PER_SM * 132:
        assert all(blocks * d < mma_kernels.BLOCKS_PER_SM * 132 for d in smaller)  # the smallest such split
    else:
        assert t.split == max(d for d in range(1, MAX_SPLIT + 1) if nsb % d == 0)


def test_measured_tilings_take_precedence_divide_their_k_and_split_it_alike_for_every_m():
    for (qtype, n, k), pair in mma_kernels.TILINGS.items():
        assert qtype in mma_kernels.QTYPES
        kept = q4k_columns.QTYPE if qtype == "Q4_K" else qtype  # the loader keeps Q4_K of these shapes so
        assert tilings_for(kept, n, k) == pair and (k // 256) % pair[0].split == 0
        assert pair[0].split == pair[1].split  # the same bits for 1-8 and 9-16 rows
        for tiling in pair:
            tiling.shared_bytes(kept)  # a ring only for a type that takes one
    assert tilings_for("Q4_K", 4096, 2048) == (default_tiling(4096, 2048),) * 2  # a shape not measured
    assert tilings_for("Q6_K_LANES", 21504, 5376) == (default_tiling(21504, 5376),) * 2  # measured for Q4_K only


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernel needs a GPU")


def test_a_ring_of_one_stage_is_refused_and_rings_take_shared_memory_per_warp():
    for stages in (1, -2):
        with pytest.raises(ValueError, match="stages"):
            MmaTiling(1, 2, 3, 1, stages)
    assert MmaTiling(1, 2, 3, 1).shared_bytes("Q4_K") == MmaTiling(1, 2, 3, 1).shared_bytes("Q6_K_LANES") == 0
    assert MmaTiling(2, 4, 3, 1, 4).shared_bytes("Q4_K") == 4 * 4 * 2 * 16 * 160  # warps x stages x rows x padded row
    assert MmaTiling(2, 4, 3, 1, 4).shared_bytes("Q5_K") == 4 * 4 * 2 * 16 * 224
    with pytest.raises(ValueError, match="Q6_K_LANES weights take no shared-memory ring"):
        MmaTiling(2, 4, 3, 1, 4).shared_bytes("Q6_K_LANES")


def test_the_copy_engines_ring_takes_unpadded_rows_of_q4k_columns_only():
    with pytest.raises(ValueError, match="bulk needs stages"):
        MmaTiling(1, 2, 1, 1, 0, bulk=True)
    bulk = MmaTiling(2, 2, 1, 1, 3, bulk=True)
    assert bulk.shared_bytes(q4k_columns.QTYPE) == 2 * 3 * 2 * 16 * 144  # warps x stages x rows x 144-byte row
    for qtype in ("Q4_K", "Q5_K"):
        with pytest.raises(ValueError, match="copy engine fills the ring of Q4_K_COLUMNS weights only"):
            bulk.shared_bytes(qtype)


def test_tilings_fill_their_rings_by_lanes_where_the_copy_engine_cannot(monkeypatch):
    """A measured tiling with bulk keeps it for Q4_K_COLUMNS on a GPU with the copy engine, and falls back to the
    lanes' copies (the same bits) for GGUF-order Q4_K or a GPU without it."""
    bulk = MmaTiling(2, 2, 1, 1, 3, bulk=True)
    monkeypatch.setitem(mma_kernels.TILINGS, ("Q4_K", 4096, 2048), (bulk, bulk))
    assert tilings_for(q4k_columns.QTYPE, 4096, 2048) == (bulk, bulk)
    lanes = MmaTiling(2, 2, 1, 1, 3)
    assert tilings_for("Q4_K", 4096, 2048) == (lanes, lanes)
    assert tilings_for(q4k_columns.QTYPE, 4096, 2048, copy_engine=False) == (lanes, lanes)


SHAPES = [(64, 512, None), (4096, 5376, None), (21504, 5376, None), (5376, 21504, None),
          (1040, 2048, MmaTiling(2, 4, 8, 1)), (48, 1024, MmaTiling(1, 2, 1, 1))]
RINGS = [(1040, 2048, MmaTiling(2, 4, 2, 1, 3)), (4096, 5376, MmaTiling(1, 2, 3, 1, 4)),
         (48, 1024, MmaTiling(1, 2, 4, 1, 2))]


@cuda
@pytest.mark.parametrize("qtype,n,k,tiling", [(q, *s) for q in ("Q4_K", "Q5_K") for s in SHAPES + RINGS]
                         + [("Q6_K_LANES", *s)
                            for s in SHAPES + [(65536, 5376, None), (1024, 4096, MmaTiling(1, 4, 16, 1))]])
def test_mma_kernel_matches_dequantized_matmul_and_is_batch_invariant(qtype, n, k, tiling):
    blocks = torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=k // 256)).cuda()
    x = torch.randn(16, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)).bfloat16()
    assert mma_kernels.supported(x, blocks, n, qtype)
    y = mma_kernels.launch(x, blocks, n, qtype, tiling)
    ref = x.double() @ dequantize(blocks, qtype).double().T
    # the weights are exact and the sums fp32: only the bf16 output rounds
    assert ((y.double() - ref).norm() / ref.norm()).item() < 4e-3
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4 * ref.abs().max()).all()
    for m in range(1, 16):
        assert torch.equal(mma_kernels.launch(x[:m], blocks, n, qtype, tiling), y[:m]), m


@cuda
@pytest.mark.parametrize("qtype", list(mma_kernels.QTYPES))
def test_quant_linear_takes_the_mma_kernel_for_decoding(qtype):
    from flashdraft.quant.linear import QuantLinear

    n, k = 256, 1024
    blocks = torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=k // 256)).cuda()
    layer = QuantLinear(blocks, qtype, k, torch.bfloat16)
    x = torch.randn(3, k, device="cuda").bfloat16()
    assert torch.equal(layer(x), mma_kernels.launch(x, blocks, n, qtype))


@cuda
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("n,k,split", [(1040, 2048, 2), (4096, 5376, 3), (48, 1024, 1)])
def test_the_shared_memory_ring_gives_the_bits_of_the_direct_loads(qtype, n, k, split):
    """Staging the weights through shared memory changes where the bytes come from, not the arithmetic: the same
    K split gives the same bits with every ring depth and warp shape."""
    blocks = torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=k // 256)).cuda()
    x = torch.randn(16, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()
    direct = mma_kernels.launch(x, blocks, n, qtype, MmaTiling(1, 2, split, 1))
    for tiling in (MmaTiling(1, 2, split, 1, 2), MmaTiling(2, 4, split, 1, 4), MmaTiling(1, 4, split, 2, 3)):
        for m in (1, 5, 16):
            assert torch.equal(mma_kernels.launch(x[:m], blocks, n, qtype, tiling), direct[:m]), (tiling, m)


@cuda
def test_tilings_for_few_and_many_rows_must_split_k_alike():
    blocks = torch.from_numpy(random_blocks("Q4_K", rows=64, blocks_per_row=4)).cuda()
    x = torch.randn(3, 1024, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="split K differently"):
        mma_kernels.launch(x, blocks, 64, "Q4_K", (MmaTiling(1, 2, 2, 1), MmaTiling(1, 2, 4, 1)))


@cuda
@pytest.mark.parametrize("qtype", list(mma_kernels.QTYPES))
def test_split_k_is_one_launch_the_same_bits_every_time_and_leaves_the_counts_at_zero(qtype):
    """With K split, the warp that finishes a column's last range adds every range's sums in range order (no reduce
    launch): one kernel per product, the same bits on every launch whichever warp comes last, the split result
    the unsplit one up to fp32 summation order, and the arrival counts zero again for the next product."""
    from torch.profiler import ProfilerActivity, profile

    n, k = _rows(qtype, 1040), 4096
    blocks = torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=k // 256)).cuda()
    x = torch.randn(16, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)).bfloat16()
    whole = mma_kernels.launch(x, blocks, n, qtype, MmaTiling(1, 2, 1, 1)).float()
    split = MmaTiling(1, 2, 8, 1)
    first = mma_kernels.launch(x, blocks, n, qtype, split)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runs = [mma_kernels.launch(x[:m], blocks, n, qtype, split) for m in (16, 16, 3, 16, 1, 16)]
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == len(runs) and all("kq_mma" in name for name in kernels), kernels
    assert all(torch.equal(run, first[:run.shape[0]]) for run in runs)
    assert ((first.float() - whole).abs() <= 2 ** -7 * whole.abs() + 1e-3 * whole.abs().max()).all()
    assert not mma_kernels._counters(torch.cuda.current_device()).any()


def test_quant_linear_adds_a_residual_as_the_sum_does():
    """QuantLinear(x, residual=r) is QuantLinear(x) + r bit for bit: on a GPU the kernel adds r as it stores its
    product (y rounded, then the sum rounded), elsewhere the add follows the product."""
    from flashdraft.quant.linear import QuantLinear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for qtype in mma_kernels.QTYPES:
        n = _rows(qtype, 64)
        blocks = torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=2)).to(device)
        layer = QuantLinear(blocks, qtype, 512, torch.bfloat16)
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
        r = torch.randn(3, n, generator=torch.Generator().manual_seed(4)).mul(8).bfloat16().to(device)
        y = layer(x)
        assert torch.equal(layer(x, residual=r), y + r) and not torch.equal(y + r, y)


@cuda
@pytest.mark.parametrize("qtype", list(mma_kernels.QTYPES))
@pytest.mark.parametrize("split", [1, 4])
def test_the_kernel_adds_the_residual_as_torch_adds_it(qtype, split):
    """In the store of one K range and in the last warp's sum of several: the bits of y + r for every M."""
    n, k = _rows(qtype, 1040), 4096
    blocks = torch.from_numpy(random_blocks(qtype, rows=n, blocks_per_row=k // 256)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(16, k, device="cuda", generator=gen).bfloat16()
    r = torch.randn(16, n, device="cuda", generator=gen).mul(30).bfloat16()
    tiling = MmaTiling(1, 2, split, 1)
    y = mma_kernels.launch(x, blocks, n, qtype, tiling)
    for m in (1, 5, 9, 16):
        assert torch.equal(mma_kernels.launch(x[:m], blocks, n, qtype, tiling, residual=r[:m]), y[:m] + r[:m]), m
    with pytest.raises(ValueError, match="residual must be bf16"):
        mma_kernels.launch(x, blocks, n, qtype, tiling, residual=r[:, :16])
    assert not mma_kernels._counters(torch.cuda.current_device()).any()


@cuda
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="the copy engine (cp.async.bulk) needs compute capability 9.0")
@pytest.mark.parametrize("n,k,split", [(1280, 2048, 2), (4096, 5376, 3), (256, 1024, 1), (43008, 5376, 1)])
def test_the_copy_engines_ring_gives_the_bits_of_the_lanes_ring(n, k, split):
    """Filling the ring by one bulk copy a warp and stage (rows unpadded, each lane group on its permuted row)
    changes where the bytes land, not the arithmetic: the bits of the lanes' ring for every M, with a residual too,
    and the split-K counts left at zero."""
    rows = torch.from_numpy(random_blocks("Q4_K", rows=n, blocks_per_row=k // 256, seed=3)).cuda()
    cols = q4k_columns.from_rows(rows)
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(16, k, device="cuda", generator=gen).bfloat16()
    res = torch.randn(16, n, device="cuda", generator=gen).bfloat16()
    for r_tiles, warps, stages, min_blocks in ((1, 2, 2, 1), (2, 2, 3, 1), (1, 4, 4, 2)):
        lanes = MmaTiling(r_tiles, warps, split, min_blocks, stages)
        bulk = MmaTiling(r_tiles, warps, split, min_blocks, stages, bulk=True)
        for m in (1, 5, 9, 16):
            want = mma_kernels.launch(x[:m], cols, n, q4k_columns.QTYPE, lanes)
            assert torch.equal(mma_kernels.launch(x[:m], cols, n, q4k_columns.QTYPE, bulk), want), (bulk, m)
        want = mma_kernels.launch(x[:3], cols, n, q4k_columns.QTYPE, lanes, residual=res[:3])
        assert torch.equal(mma_kernels.launch(x[:3], cols, n, q4k_columns.QTYPE, bulk, residual=res[:3]), want)
    assert not mma_kernels._counters(torch.cuda.current_device()).any()


@cuda
@pytest.mark.parametrize("n,k,tiling", [(4096, 5376, None), (21504, 5376, None), (5376, 21504, None),
                                        (1024, 2048, MmaTiling(2, 4, 8, 1)), (256, 1024, MmaTiling(1, 2, 1, 1)),
                                        (1280, 2048, MmaTiling(2, 4, 2, 1, 3)), (4096, 5376, MmaTiling(1, 2, 3, 1, 4)),
                                        (24576, 4096, None), (6144, 4096, None)])
def test_super_block_major_q4k_gives_the_bits_of_gguf_order(n, k, tiling):
    """The kernel reading Q4_K_COLUMNS blocks (chunks of 256 rows super-block-major) computes what it computes on
    GGUF's rows, bit for bit, with direct loads and through the shared-memory ring, one K range or several, and the
    measured tilings (24576 x 4096 and 6144 x 4096 ring their 9-16-row passes), for every M; and a QuantLinear's
    other passes on the GPU match too: 40 rows (the Triton product) and a prefill's 128 (the dequantized copy),
    both reading the chunks where they lie."""
    from flashdraft.kernels.gguf_triton import DEQUANT_MIN_ROWS
    from flashdraft.quant.linear import QuantLinear

    rows = torch.from_numpy(random_blocks("Q4_K", rows=n, blocks_per_row=k // 256, seed=7)).cuda()
    cols = q4k_columns.from_rows(rows)
    x = torch.randn(DEQUANT_MIN_ROWS, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(8))
    x = x.bfloat16()
    assert mma_kernels.supported(x[:16], cols, n, q4k_columns.QTYPE)
    for m in (1, 5, 9, 16):
        want = mma_kernels.launch(x[:m], rows, n, "Q4_K", tiling)
        assert torch.equal(mma_kernels.launch(x[:m], cols, n, q4k_columns.QTYPE, tiling), want), m
    kept = QuantLinear(rows, "Q4_K", k, torch.bfloat16, by_columns=True)
    in_order = QuantLinear(rows, "Q4_K", k, torch.bfloat16)
    assert kept.qtype == q4k_columns.QTYPE
    for m in (3, 40, DEQUANT_MIN_ROWS):
        assert torch.equal(kept(x[:m]), in_order(x[:m])), m
