"""Stream a weight into the GPU's L2 cache on a side stream while the main stream runs latency-bound kernels.

At batch 1, the part of a decoder layer between the q/k/v and o projections (qkv_prep, then attention over the
cached rows) takes about 12 us of an H200's time and reads only a few MB: the memory bus is mostly idle. o_proj's
weight (34 MB at the Qwen3-8B and Llama-3.1-8B shapes, in the 60 MB L2) can stream in meanwhile, so that the o_proj
GEMM then reads it from L2 instead of from HBM (Attention.fused_forward does this; docs/performance.md measures it).

`start(weight)` forks a side stream off the current one and launches there a kernel that reads the weight once
through L2 (`launch`); `join(handle)` makes the current stream wait for it. Inside CUDA graph capture the two
become a fork and a join of the graph. Nothing is computed from the weight, so no result changes.

Only on CUDA and only for weights up to L2_SHARE of the L2, so that the lines read are still there when the GEMM
reads them; elsewhere `start` does nothing and returns None. FLASHDRAFT_L2_PREFETCH=0 switches it off (the
benchmarks' comparison).
"""
from __future__ import annotations

import functools
import os

import torch

L2_SHARE = 0.75  # prefetch weights up to this share of the L2
BLOCK = 2048  # int32 words per load of one program
PROGRAMS_PER_SM = 2


@functools.cache
def _kernels():
    from flashdraft.layers import _l2_prefetch_triton
    return _l2_prefetch_triton


def enabled() -> bool:
    return os.environ.get("FLASHDRAFT_L2_PREFETCH", "1") not in ("", "0")


def launch(weight: torch.Tensor, sink: torch.Tensor, block: int = BLOCK, num_warps: int = 4) -> None:
    """Read every byte of `weight` (contiguous, a whole number of 4-byte words) once, with len(sink) programs, each
    storing the xor of the int32 words it read into its slot of `sink` (int32)."""
    if not weight.is_contiguous() or (weight.numel() * weight.element_size()) % 4:
        raise ValueError(f"l2_prefetch: the weight must be contiguous and a whole number of 4-byte words, got "
                         f"{list(weight.shape)} {weight.dtype} (contiguous: {weight.is_contiguous()})")
    if sink.dtype != torch.int32 or sink.dim() != 1 or sink.device != weight.device:
        raise ValueError(f"l2_prefetch: the sink must be a 1-D int32 tensor on {weight.device}, got "
                         f"{list(sink.shape)} {sink.dtype} on {sink.device}")
    words = weight.reshape(-1).view(torch.uint8).view(torch.int32)
    programs = sink.numel()
    steps = -(-words.numel() // (programs * block))
    _kernels().l2_prefetch_kernel[(programs,)](words, sink, words.numel(), BLOCK=block, STEPS=steps,
                                                num_warps=num_warps)


@functools.cache
def _device_facts(device: torch.device) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device)
    return props.L2_cache_size, props.multi_processor_count


_SIDE: dict[torch.device, torch.cuda.Stream] = {}
_SINK: dict[torch.device, torch.Tensor] = {}


def fits(weight: torch.Tensor) -> bool:
    """Whether start() prefetches this weight: CUDA, switched on, contiguous, and at most L2_SHARE of the L2."""
    if weight.device.type != "cuda" or not enabled() or not weight.is_contiguous():
        return False
    nbytes = weight.numel() * weight.element_size()
    return nbytes % 4 == 0 and nbytes <= L2_SHARE * _device_facts(weight.device)[0]


def start(weight: torch.Tensor) -> torch.cuda.Stream | None:
    """Begin reading `weight` into L2 on a side stream; returns the handle for join, or None where not done."""
    if not fits(weight):
        return None
    device = weight.device
    if device not in _SIDE:  # made before any capture: every pass runs eagerly once before its graph is captured
        _SIDE[device] = torch.cuda.Stream(device)
        _SINK[device] = torch.zeros(PROGRAMS_PER_SM * _device_facts(device)[1], dtype=torch.int32, device=device)
    side = _SIDE[device]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        launch(weight, _SINK[device])
    return side


def join(handle: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for a prefetch begun by start (None: nothing to wait for)."""
    if handle is not None:
        torch.cuda.current_stream(handle.device).wait_stream(handle)
