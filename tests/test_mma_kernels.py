"""The CUDA tensor-core Q4_K kernel (flashdraft.quant.mma_kernels): which products it takes, its tilings, and on a
GPU its results (against dequantize + matmul in float64) and bitwise batch invariance over every M <= 16."""
import pytest
import torch

from flashdraft.quant import dequantize, mma_kernels
from flashdraft.quant.mma_kernels import MAX_SPLIT, MmaTiling, default_tiling, tiling_for
from test_gguf_quant import random_blocks


def test_products_off_the_gpu_are_not_taken():
    x = torch.zeros(2, 512, dtype=torch.bfloat16)
    assert not mma_kernels.supported(x, torch.zeros(32, 288, dtype=torch.uint8), 32)


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


def test_measured_tilings_take_precedence_and_divide_their_k():
    for (n, k), t in mma_kernels.TILINGS.items():
        assert tiling_for(n, k) == t and (k // 256) % t.split == 0
    assert tiling_for(4096, 4096) == default_tiling(4096, 4096)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernel needs a GPU")


@cuda
@pytest.mark.parametrize("n,k,tiling", [(64, 512, None), (4096, 5376, None), (1040, 2048, MmaTiling(2, 4, 8, 1)),
                                        (48, 1024, MmaTiling(1, 2, 1, 1))])
def test_mma_kernel_matches_dequantized_matmul_and_is_batch_invariant(n, k, tiling):
    blocks = torch.from_numpy(random_blocks("Q4_K", rows=n, blocks_per_row=k // 256)).cuda()
    x = torch.randn(16, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)).bfloat16()
    assert mma_kernels.supported(x, blocks, n)
    y = mma_kernels.launch(x, blocks, n, tiling)
    ref = x.double() @ dequantize(blocks, "Q4_K").double().T
    # the weights are exact and the sums fp32: only the bf16 output rounds
    assert ((y.double() - ref).norm() / ref.norm()).item() < 4e-3
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4 * ref.abs().max()).all()
    for m in range(1, 16):
        assert torch.equal(mma_kernels.launch(x[:m], blocks, n, tiling), y[:m]), m


@cuda
def test_quant_linear_takes_the_mma_kernel_for_q4_k_decoding():
    from flashdraft.quant.linear import QuantLinear

    n, k = 256, 1024
    blocks = torch.from_numpy(random_blocks("Q4_K", rows=n, blocks_per_row=k // 256)).cuda()
    layer = QuantLinear(blocks, "Q4_K", k, torch.bfloat16)
    x = torch.randn(3, k, device="cuda").bfloat16()
    assert torch.equal(layer(x), mma_kernels.launch(x, blocks, n))
