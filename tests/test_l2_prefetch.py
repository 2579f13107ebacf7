"""The L2 prefetch (flashdraft.layers.l2_prefetch): its kernel reads every word of a weight once (under Triton's
interpreter on the CPU), argument checks, and where it is skipped."""

import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import interpret_without_gpu  # noqa: E402

from flashdraft.layers import l2_prefetch  # noqa: E402

interpret_without_gpu("flashdraft.layers._l2_prefetch_triton", l2_prefetch._kernels)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _xor_of(words: torch.Tensor) -> int:
    acc = 0
    for w in words.tolist():
        acc ^= w
    return acc


@pytest.mark.parametrize("shape, dtype, programs, block", [
    ((48, 40), torch.bfloat16, 3, 64),   # 960 words: 5 steps of 64 per program, the last program's tail masked
    ((7, 9), torch.float32, 4, 16),      # 63 words: a ragged end inside a block, one program reads nothing
    ((64,), torch.float16, 1, 16),       # one program, two steps
])
def test_prefetch_kernel_reads_every_word_once(shape, dtype, programs, block):
    """Each program's slot of the sink is the xor of exactly its own consecutive range of words: a word skipped,
    read twice or read by the wrong program changes it (the weights are random bits)."""
    g = torch.Generator().manual_seed(sum(shape))
    weight = torch.randint(-2**31, 2**31 - 1, (torch.Size(shape).numel() * dtype.itemsize // 4,), generator=g,
                           dtype=torch.int32).view(dtype).reshape(shape).to(DEVICE)
    sink = torch.full((programs,), 12345, dtype=torch.int32, device=DEVICE)
    l2_prefetch.launch(weight, sink, block=block)
    words = weight.reshape(-1).view(torch.int32).cpu()
    per_program = -(-words.numel() // (programs * block)) * block
    expected = [_xor_of(words[p * per_program:(p + 1) * per_program]) for p in range(programs)]
    assert sink.cpu().tolist() == expected
    assert any(expected)  # the check could fail: random words do not xor to zero


def test_prefetch_checks_its_arguments():
    sink = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch.launch(torch.zeros(8, 6, device=DEVICE).t(), sink)
    with pytest.raises(ValueError, match="4-byte words"):
        l2_prefetch.launch(torch.zeros(3, dtype=torch.bfloat16, device=DEVICE), sink)
    with pytest.raises(ValueError, match="int32"):
        l2_prefetch.launch(torch.zeros(8, device=DEVICE), torch.zeros(2, device=DEVICE))


def test_prefetch_runs_only_on_cuda_and_when_switched_on(monkeypatch):
    weight = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEVICE)
    if DEVICE == "cpu":
        assert l2_prefetch.start(weight) is None and not l2_prefetch.fits(weight)
        l2_prefetch.join(None)  # nothing to wait for
        return
    assert l2_prefetch.fits(weight) and not l2_prefetch.fits(weight.t())
    big = torch.empty(int(l2_prefetch._device_facts(weight.device)[0] * l2_prefetch.L2_SHARE) // 2 + 2,
                      dtype=torch.bfloat16, device=DEVICE)
    assert not l2_prefetch.fits(big)  # past its share of the L2
    handle = l2_prefetch.start(weight)
    assert handle is not None
    l2_prefetch.join(handle)
    monkeypatch.setenv("FLASHDRAFT_L2_PREFETCH", "0")
    assert l2_prefetch.start(weight) is None
