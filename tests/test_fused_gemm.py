"""The skinny GEMM's fusions (flashdraft.layers.skinny_gemm: rms_norm_eps with the norm's weight folded into W,
gated, residual) under Triton's interpreter on the CPU (compiled on CUDA): against a float64 reference of the
same math, batch invariance, the weight folding, the custom op's fake implementation and the argument checks."""

import pytest
import torch
import torch.nn.functional as F

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

pytest.importorskip("triton")

from triton_interpreter import interpret_without_gpu  # noqa: E402

from flashdraft.layers import elementwise  # noqa: E402
from flashdraft.layers import skinny_gemm as sg  # noqa: E402

interpret_without_gpu("flashdraft.kernels.skinny_triton", sg._kernels)

EPS = 1e-6
FUSIONS = {  # name: (norm, gated, residual)
    "norm": (True, False, False),
    "gated": (False, True, False),
    "norm+gated": (True, True, False),
    "residual": (False, False, True),
}
# (n output features, k, config): weight tile on the left with uneven N and K (masked edges); plain operand order
# with even N and K; an uneven split of K (7 steps in 3 ranges: residual and bias go through the split-K reduce
# kernel; norm and gated run the config with split_k = 1).
CASES = [
    (40, 200, sg.SkinnyConfig(32, 64, swap=True)),
    (48, 256, sg.SkinnyConfig(16, 64)),
    (48, 200, sg.SkinnyConfig(16, 32, split_k=3)),
]


def _tol(dtype):
    # bf16: output rounding (the interpreter truncates fp32 -> bf16: up to 2 ** -7) and the folded weights' rounding
    return 1e-5 if dtype == torch.float32 else 1e-2


def _rel_err(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def _inputs(n, k, dtype, fusion, seed, rows=16):
    """x, weight, bias, norm_weight, residual (the last two None unless the fusion uses them). x's rms is about 3,
    so a missing norm shows."""
    norm, gated, residual = FUSIONS[fusion]
    g = torch.Generator().manual_seed(seed)
    w_rows = 2 * n if gated else n

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    return (rnd(rows, k, scale=3.0), rnd(w_rows, k, scale=k ** -0.5), rnd(w_rows),
            (1 + rnd(k, scale=0.25)) if norm else None, rnd(rows, n) if residual else None)


def _reference(x, w, b, norm_weight=None, residual=None, gate_act=None):
    """float64: residual + gate_act(gate) * up (gate_act None: not gated) of rms_norm(x) @ w^T + b."""
    x = x.double()
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    y = x @ w.double().T
    if b is not None:
        y = y + b.double()
    if gate_act is not None:
        gate, up = y.chunk(2, dim=-1)
        y = gate_act(gate) * up
    return y if residual is None else y + residual.double()


def _launch(x, w, b, nw, r, gated, config):
    """The kernel computing _reference's math: with a norm weight, its weight folded into (a copy of) w."""
    if nw is not None:
        w = w.clone()
        sg.fold_norm_weight(w, nw)
    return sg.launch(x, w, b, config, rms_norm_eps=None if nw is None else EPS, residual=r, gated=gated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,config", CASES)
@pytest.mark.parametrize("fusion", FUSIONS)
def test_fusion_matches_float64(fusion, n, k, config, dtype):
    gated = FUSIONS[fusion][1]
    x, w, b, nw, r = _inputs(n, k, dtype, fusion, seed=n * k)
    act = F.silu if gated else None
    y = _launch(x, w, b, nw, r, gated, config)
    assert y.shape == (16, n) and y.dtype == dtype
    ref = _reference(x, w, b, nw, r, act)
    assert _rel_err(y, ref) < _tol(dtype)
    # The tolerance tells the fusions apart: leaving one out of the reference is far off.
    if nw is not None:
        assert _rel_err(y, _reference(x, w, b, None, r, act)) > 0.1
    if r is not None:
        assert _rel_err(y, _reference(x, w, b, nw, None, act)) > 0.1
    if gated:
        assert _rel_err(y, _reference(x, w, b, nw, r, lambda gate: gate)) > 0.1
    # without a bias, and fewer rows
    r5 = None if r is None else r[:5]
    y5 = _launch(x[:5], w, None, nw, r5, gated, config)
    assert _rel_err(y5, _reference(x[:5], w, None, nw, r5, act)) < _tol(dtype)


@pytest.mark.parametrize("n,k,config", CASES)
@pytest.mark.parametrize("fusion", ["norm", "norm+gated", "residual"])
def test_fused_rows_are_batch_invariant(fusion, n, k, config):
    """Rows 0..M-1 of an M-row call (M = 1, 3) are bitwise those of a 16-row call whose other rows hold other
    (random) data."""
    gated = FUSIONS[fusion][1]
    x, w, b, nw, r = _inputs(n, k, torch.bfloat16, fusion, seed=n + k)
    y = _launch(x, w, b, nw, r, gated, config)
    for m in (1, 3):
        assert torch.equal(_launch(x[:m], w, b, nw, None if r is None else r[:m], gated, config), y[:m])


def test_fold_norm_weight():
    """F.linear(rms_norm(x, g), W) == F.linear(rms_norm(x, 1), W with g folded into its columns)."""
    g = torch.Generator().manual_seed(3)
    x, w, nw = torch.randn(4, 64, generator=g), torch.randn(24, 64, generator=g), 1 + torch.rand(64, generator=g)
    folded = w.clone()
    sg.fold_norm_weight(folded, nw)
    torch.testing.assert_close(F.linear(elementwise.rms_norm(x, torch.ones(64), EPS), folded),
                               F.linear(elementwise.rms_norm(x, nw, EPS), w), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(folded, w)


def test_custom_op_fake_shapes():
    """The op's schema takes the fusion arguments and its fake implementation gives the gated output shape."""
    x = torch.randn(3, 32).to(DEVICE)
    w = torch.randn(32, 32).to(DEVICE)
    r = torch.randn(3, 16).to(DEVICE)
    op = torch.ops.flashdraft.skinny_linear.default
    for args in [(x, w, None, EPS, None, True), (x, w[:16], None, None, r, False)]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    assert sg.skinny_linear(x, w, gated=True).shape == (3, 16)


def test_bad_arguments_are_named():
    x = torch.randn(2, 32).to(DEVICE)
    w = torch.randn(48, 32).to(DEVICE)
    with pytest.raises(ValueError, match="gated needs the gate rows"):
        sg.launch(x, w[:47], gated=True)
    with pytest.raises(ValueError, match="residual is"):
        sg.launch(x, w, residual=torch.randn(2, 24).to(DEVICE))
    with pytest.raises(ValueError, match="residual is"):
        sg.launch(x, w, gated=True, residual=torch.randn(2, 48).to(DEVICE))  # gated: the output has 24 features
    with pytest.raises(ValueError, match="residual is"):
        sg.launch(x, w, residual=torch.randn(2, 48, dtype=torch.float64).to(DEVICE))
    with pytest.raises(ValueError, match="bias is"):
        sg.launch(x, w, torch.randn(24).to(DEVICE), gated=True)
