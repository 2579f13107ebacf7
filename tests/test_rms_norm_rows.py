"""layers.rms_norm_rows, the one-kernel RMSNorm (with an optional residual add before it) of DecoderLayer's
quant_forward: against elementwise.rms_norm's eager steps, rows bitwise the same alone as in a block, and its
arguments checked. Triton's interpreter runs the kernel on the CPU."""
import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import interpret_without_gpu  # noqa: E402

from flashdraft.layers import rms_norm_rows as module  # noqa: E402
from flashdraft.layers.elementwise import rms_norm  # noqa: E402
from flashdraft.layers.rms_norm_rows import rms_norm_rows  # noqa: E402

interpret_without_gpu("flashdraft.kernels.rms_norm_triton", module._kernels)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(T, N, generator=g).mul(3).to(dtype).to(DEVICE) for _ in range(2))
    w = (0.5 + torch.rand(N, generator=g)).to(dtype).to(DEVICE)
    return x, r, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N", [256, 200])  # a power of two, and a row that fills part of its block
def test_matches_the_eager_norm(dtype, N):
    x, r, w = _inputs(7, N, dtype)
    s, y = rms_norm_rows(x, w, 1e-6)
    assert s is x
    ref = rms_norm(x, w, 1e-6)
    # the sum of squares is the kernel's own order: an ulp in float32, almost never visible after a bf16 rounding
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    if dtype != torch.float32:
        assert (y != ref).float().mean().item() < 0.01
    s, y = rms_norm_rows(x, w, 1e-6, residual=r)
    assert torch.equal(s, x + r)  # the sum rounded once to dtype, as torch's add
    torch.testing.assert_close(y, rms_norm(x + r, w, 1e-6), rtol=tol, atol=tol)


def test_rows_are_the_same_bits_alone_as_in_a_block():
    x, r, w = _inputs(16, 384, torch.bfloat16, seed=1)
    s, y = rms_norm_rows(x, w, 1e-5, residual=r)
    for i in (0, 5, 15):
        s_i, y_i = rms_norm_rows(x[i:i + 1], w, 1e-5, residual=r[i:i + 1])
        assert torch.equal(s_i[0], s[i]) and torch.equal(y_i[0], y[i])


def test_bad_arguments_are_named():
    x, r, w = _inputs(3, 64, torch.float32)
    with pytest.raises(ValueError, match="weight must be torch.float32 \\[64\\]"):
        rms_norm_rows(x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_rows(x, w.double(), 1e-6)
    with pytest.raises(ValueError, match="x must be \\[T, N\\]"):
        rms_norm_rows(x[None], w, 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm_rows(x, w, 1e-6, residual=r[:2])
    s, y = rms_norm_rows(x[:0], w, 1e-6)  # an empty pass launches nothing
    assert y.shape == (0, 64)
