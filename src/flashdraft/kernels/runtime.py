"""Where the Triton kernels can run, and the GPU's multiprocessor count that their tilings follow. Imports no
Triton itself, so importing flashdraft never needs it."""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1, as the CPU tests set it before the first launch)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def can_run(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run for tensors on `device`: CUDA with Triton, or Triton's interpreter."""
    device = torch.device(device)
    return triton_available() and (device.type == "cuda" or interpreting())


@functools.cache
def gpu_sm_count(device_index: int) -> int:
    """Multiprocessors of that GPU."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
