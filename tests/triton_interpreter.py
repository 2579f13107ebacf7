"""Triton's interpreter for the kernel tests on a machine without a GPU."""
import os
import sys

import torch


def interpret_without_gpu(kernel_module: str, kernels_cache) -> None:
    """Without a GPU, switch on Triton's interpreter for `kernel_module`. triton.jit reads TRITON_INTERPRET when
    a kernel is decorated, which for ours is when the kernel module is first imported (first launch), so it is set
    here, before any launch, and that module is dropped in case something imported it earlier, with the cached
    handle to it (`kernels_cache`, a functools.cache). It stays set for the session (nothing else runs Triton
    in-process on the CPU)."""
    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    sys.modules.pop(kernel_module, None)
    kernels_cache.cache_clear()
