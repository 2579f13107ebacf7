"""kernels.runtime.opaque_op: one opaque op inside torch.compile'd code, the function itself when called eagerly
(a custom op's dispatch costs the host more than a kernel launch, and eager passes are bound by the host)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashdraft.kernels.runtime import opaque_op


def _doubled_like(x, scale):
    return torch.empty_like(x)


@opaque_op("flashdraft_test::scaled", _doubled_like)
def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_eager_call_runs_the_function_without_the_dispatcher():
    x = torch.arange(4.0)
    with _Ops() as ops:
        y = scaled(x, 3.0)
    assert torch.equal(y, 3 * x)
    assert ops.names and not any("flashdraft_test" in name for name in ops.names), ops.names


def test_compiled_code_sees_one_opaque_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: scaled(x, 2.0) + 1, backend=backend, fullgraph=True)
    x = torch.arange(5.0)
    assert torch.equal(compiled(x), 2 * x + 1)
    assert any("flashdraft_test.scaled" in target for target in graphs[0]), graphs
    assert not any("mul" in target for target in graphs[0]), graphs  # not traced into
    torch._dynamo.reset()
