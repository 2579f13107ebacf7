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


def _gemma_reference(x, h, w, w_next=None, scalar=None, eps=1e-6):
    """Gemma4DecoderLayer's joins on the module path: s = h + Gemma4RMSNorm(x) (times the layer scalar), and the
    next norm of s."""
    from flashdraft.models.gemma4.model import Gemma4RMSNorm

    def norm(v, weight):
        m = Gemma4RMSNorm(v.shape[1], eps).to(v.device)
        m.weight = torch.nn.Parameter(weight)
        return m(v)

    s = h + norm(x, w)
    if scalar is not None:
        s = s * scalar
    return s, (norm(s, w_next) if w_next is not None else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [256, 200])
def test_gemma_joins_match_the_module_path(dtype, N):
    from flashdraft.layers.rms_norm_rows import gemma_add_norm, gemma_add_scaled_norm, gemma_norm

    x, h, w = _inputs(7, N, dtype, seed=2)
    w_next = (0.25 + torch.rand(N, generator=torch.Generator().manual_seed(3))).to(dtype).to(DEVICE)
    scalar = torch.tensor([0.75], dtype=dtype, device=DEVICE)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    s, y = gemma_add_norm(x, h, w, w_next, 1e-6)
    ref_s, ref_y = _gemma_reference(x, h, w, w_next)
    torch.testing.assert_close(s, ref_s, rtol=tol, atol=tol)
    torch.testing.assert_close(y, ref_y, rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # the rounding points are the module's: bits differ only by the sum's order
        assert (s != ref_s).float().mean().item() < 0.02 and (y != ref_y).float().mean().item() < 0.02
    out, out_next = gemma_add_scaled_norm(x, h, w, scalar, w_next, 1e-6)
    ref_out, ref_next = _gemma_reference(x, h, w, w_next, scalar=scalar)
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(out_next, ref_next, rtol=tol, atol=tol)
    # the next layer's input norm, computed in the join, is the bits of that norm alone on the join's output
    assert torch.equal(out_next, gemma_norm(out, w_next, 1e-6))
    if dtype == torch.bfloat16:
        assert (out != ref_out).float().mean().item() < 0.02
        # the scalar product rounds on its own, after the sum: not (h + norm(x) w) * scalar in float32
        assert not torch.equal(out, (h.float() + _gemma_reference(x, torch.zeros_like(h), w)[0].float())
                               .mul(scalar.float()).to(dtype))


def test_gemma_join_rows_are_the_same_bits_alone_as_in_a_block():
    from flashdraft.layers.rms_norm_rows import gemma_add_norm, gemma_add_scaled_norm

    x, h, w = _inputs(16, 384, torch.bfloat16, seed=4)
    scalar = torch.tensor([1.5], dtype=torch.bfloat16, device=DEVICE)
    s, y = gemma_add_norm(x, h, w, w.flip(0), 1e-6)
    out, out_next = gemma_add_scaled_norm(x, h, w, scalar, w.flip(0), 1e-6)
    for i in (0, 9, 15):
        s_i, y_i = gemma_add_norm(x[i:i + 1], h[i:i + 1], w, w.flip(0), 1e-6)
        assert torch.equal(s_i[0], s[i]) and torch.equal(y_i[0], y[i])
        o_i, n_i = gemma_add_scaled_norm(x[i:i + 1], h[i:i + 1], w, scalar, w.flip(0), 1e-6)
        assert torch.equal(o_i[0], out[i]) and torch.equal(n_i[0], out_next[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_moe_norms_match_the_module_path_and_rows_are_alone_as_in_a_block(dtype):
    """gemma_norm (the MoE layers' norms of the residual, with a weight or, the router's, without) and gemma_add
    (the join of the shared MLP's and the experts' normed outputs) against Gemma4RMSNorm modules."""
    from flashdraft.layers.rms_norm_rows import gemma_add, gemma_norm
    from flashdraft.models.gemma4.model import Gemma4RMSNorm

    x, h, w = _inputs(16, 200, dtype, seed=5)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    bare = Gemma4RMSNorm(200, 1e-6, with_weight=False)
    weighted = _gemma_reference(x, torch.zeros_like(h), w)[0]  # 0 + norm(x) w: norm(x) w's own bits
    for got, ref in ((gemma_norm(x, w, 1e-6), weighted), (gemma_norm(x, None, 1e-6), bare(x)),
                     (gemma_add(x, h, w, 1e-6), _gemma_reference(x, h, w)[0])):
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        if dtype == torch.bfloat16:  # the module's rounding points: bits differ only by the sum's order
            assert (got != ref).float().mean().item() < 0.02
    assert not torch.allclose(gemma_norm(x, w, 1e-6), gemma_norm(x, None, 1e-6), rtol=tol, atol=tol)
    for i in (0, 7, 15):
        assert torch.equal(gemma_norm(x[i:i + 1], w, 1e-6)[0], gemma_norm(x, w, 1e-6)[i])
        assert torch.equal(gemma_norm(x[i:i + 1], None, 1e-6)[0], gemma_norm(x, None, 1e-6)[i])
        assert torch.equal(gemma_add(x[i:i + 1], h[i:i + 1], w, 1e-6)[0], gemma_add(x, h, w, 1e-6)[i])


def test_gemma_join_arguments_are_named():
    from flashdraft.layers.rms_norm_rows import gemma_add_norm, gemma_add_scaled_norm

    x, h, w = _inputs(3, 64, torch.float32)
    with pytest.raises(ValueError, match="h must be torch.float32 \\[3, 64\\]"):
        gemma_add_norm(x, h[:2], w, w, 1e-6)
    with pytest.raises(ValueError, match="next_weight must be \\[64\\]"):
        gemma_add_norm(x, h, w, w[:8], 1e-6)
    with pytest.raises(ValueError, match="scalar must be one value"):
        gemma_add_scaled_norm(x, h, w, w, w, 1e-6)
    with pytest.raises(ValueError, match="x must be \\[T, N\\]"):
        gemma_add_scaled_norm(x[None], h, w, w[:1], w, 1e-6)
    with pytest.raises(ValueError, match="next_weight must be \\[64\\]"):
        gemma_add_scaled_norm(x, h, w, w[:1], w[:8], 1e-6)
    from flashdraft.layers.rms_norm_rows import gemma_add, gemma_norm
    with pytest.raises(ValueError, match="weight must be \\[64\\]"):
        gemma_norm(x, w[:8], 1e-6)
    with pytest.raises(ValueError, match="h must be torch.float32 \\[3, 64\\]"):
        gemma_add(x, h[:, :32], w, 1e-6)
