"""Programmatic dependent launches (flashdraft.kernels.programmatic): the launch structures as cuda.h lays them out,
no PDL off CUDA, and on a Hopper GPU a chain of such launches (the GGUF layer's kernels) captured in a CUDA graph
giving the bits of the same kernels run one at a time, replay after replay: each waits for the one before it."""
import ctypes

import pytest
import torch

from flashdraft.kernels import programmatic
from test_gguf_quant import random_blocks


def test_launch_structures_match_cuda_h():
    """CUlaunchAttribute: an int id padded to 8 bytes, then a 64-byte value union; CUlaunchConfig: six grid and
    block dimensions, the shared memory, the stream at offset 32, the attributes at 40, their count at 48."""
    assert ctypes.sizeof(programmatic._LaunchAttribute) == 72
    assert programmatic._LaunchAttribute.value.offset == 8
    config = programmatic._LaunchConfig
    assert (config.shared_mem.offset, config.stream.offset, config.attrs.offset, config.num_attrs.offset) == \
        (24, 32, 40, 48)
    assert ctypes.sizeof(config) == 56


def test_no_programmatic_launch_off_cuda():
    assert programmatic.triton_options(object(), torch.device("cpu")) == {}


def test_arguments_are_tensors_or_ints():
    with pytest.raises(TypeError, match="tensors or ints"):
        programmatic.launch(None, (1, 1, 1), (32, 1, 1), [1.5], 0, None)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="programmatic dependent launches need compute capability 9.0")


@hopper
@pytest.mark.parametrize("m", [1, 16])
def test_a_graph_of_programmatic_launches_keeps_the_streams_order(m):
    from flashdraft.layers.rms_norm_rows import rms_norm_rows
    from flashdraft.layers.swiglu_rows import swiglu_rows
    from flashdraft.quant import mma_kernels

    assert programmatic.supported(torch.cuda.current_device())
    k, inter = 1024, 2048
    gen = torch.Generator(device="cuda").manual_seed(7)
    gate_up = torch.from_numpy(random_blocks("Q4_K", rows=2 * inter, blocks_per_row=k // 256)).cuda()
    down = torch.from_numpy(random_blocks("Q6_K_LANES", rows=k, blocks_per_row=inter // 256)).cuda()
    norm_w = torch.randn(k, device="cuda", generator=gen).bfloat16()
    h = torch.randn(m, k, device="cuda", generator=gen).bfloat16()

    def layer(stepwise: bool) -> torch.Tensor:
        out = [h]

        def then(fn):
            out.append(fn(out[-1]))
            if stepwise:  # each kernel launched only once the one before it has finished
                torch.cuda.synchronize()
        then(lambda x: rms_norm_rows(x, norm_w, 1e-6)[1])
        then(lambda x: mma_kernels.launch(x, gate_up, 2 * inter, "Q4_K"))
        then(swiglu_rows)
        then(lambda x: mma_kernels.launch(x, down, k, "Q6_K_LANES", residual=h))
        then(lambda x: rms_norm_rows(x, norm_w, 1e-6, residual=h)[1])
        return out[-1]

    layer(False)  # builds the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(False)
    for _ in range(3):
        h.copy_(torch.randn(m, k, device="cuda", generator=gen).bfloat16())
        graph.replay()
        expected = layer(True)
        assert torch.equal(y, expected)
    assert not mma_kernels._counters(torch.cuda.current_device()).any()
