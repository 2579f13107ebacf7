"""layers.swiglu_rows, SwiGLU of DecoderLayer's quant_forward as one kernel: against the eager F.silu(gate) * up
(bf16 bit for bit under Triton's interpreter; within an ulp of float32, and of silu's rounding on a GPU, whose
exp is Triton's),
rows bitwise the same alone as in a block, and its argument checked."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from triton_interpreter import interpret_without_gpu  # noqa: E402

from flashdraft.layers import swiglu_rows as module  # noqa: E402
from flashdraft.layers.swiglu_rows import swiglu_rows  # noqa: E402

interpret_without_gpu("flashdraft.kernels.swiglu_triton", module._kernels)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1024, 1500])  # whole blocks of features, and a last block in part
def test_matches_the_eager_activation_and_rows_do_not_depend_on_the_block(dtype, N):
    gate_up = (torch.randn(5, 2 * N, generator=torch.Generator().manual_seed(N)) * 4).to(dtype).to(DEVICE)
    y = swiglu_rows(gate_up)
    ref = F.silu(gate_up[:, :N]) * gate_up[:, N:]
    assert y.shape == (5, N) and y.dtype == dtype
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        assert torch.equal(y, ref)
    else:
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    for row in range(5):
        assert torch.equal(swiglu_rows(gate_up[row:row + 1]), y[row:row + 1])
    assert not torch.equal(y, gate_up[:, :N] * gate_up[:, N:])  # the activation is applied


def test_refuses_what_is_not_a_gate_up_pair():
    for bad in (torch.zeros(2, 7), torch.zeros(8), torch.zeros(4, 2).t()):
        with pytest.raises(ValueError, match="swiglu_rows: gate_up must be"):
            swiglu_rows(bad.to(DEVICE))
