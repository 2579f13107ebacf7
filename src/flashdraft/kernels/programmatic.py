"""Programmatic dependent launches (PDL, compute capability 9.0 and newer): a kernel launched so may start while
the kernel before it in the stream still runs, up to its own `griddepcontrol.wait`; the earlier kernel lets it
start with `griddepcontrol.launch_dependents` (or by finishing). A decode step is a chain of short kernels, each
paying its launch and its first loads' latency with the memory bus idle (about 5 us a k-quant product on the
H100, docs/performance.md): launched so, a product fetches its first weights while the kernel before it ends.

Every kernel launched here waits before it reads anything an earlier kernel writes, and before it writes
anything; that keeps the stream's order for every value, so results are the bits of plain launches.
`launch` does it for a kernel compiled by NVRTC (torch.cuda._compile_kernel, which launches through
cuLaunchKernel and has no launch attributes); Triton kernels take `triton_options`.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from flashdraft.kernels.runtime import interpreted

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


@functools.cache
def _driver():
    """libcuda's cuLaunchKernelEx (CUDA 12.0 and newer), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        launch = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                       ctypes.c_void_p]
    return lib


@functools.cache
def supported(device_index: int) -> bool:
    """Whether kernels on this GPU are launched as programmatic dependents: compute capability 9.0 or newer, and
    a driver with cuLaunchKernelEx."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0) and _driver() is not None


def launch(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, shared_mem: int,
           stream: torch.cuda.Stream) -> None:
    """`kernel(grid=, block=, args=, shared_mem=, stream=)` of a torch.cuda._compile_kernel kernel, launched as a
    programmatic dependent. Arguments as that call takes them: tensors (passed as pointers) and ints (C int)."""
    keep, pointers = [], []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            value = ctypes.c_void_p(arg.data_ptr())
        elif isinstance(arg, int):
            value = ctypes.c_int(arg)
        else:
            raise TypeError(f"kernel arguments are tensors or ints, got {type(arg).__name__}")
        keep.append(value)
        pointers.append(ctypes.cast(ctypes.byref(value), ctypes.c_void_p))
    params = (ctypes.c_void_p * len(pointers))(*pointers)
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                           ctypes.c_void_p(stream.cuda_stream), ctypes.pointer(attribute), 1)
    lib = _driver()
    status = lib.cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None)
    if status:
        message = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(message))
        raise RuntimeError(f"cuLaunchKernelEx failed: {(message.value or b'').decode() or status}")


def triton_options(kernel, device: torch.device) -> dict:
    """The keyword arguments that launch this Triton kernel as a programmatic dependent on `device` where that
    is supported (its PDL constexpr on: the kernel waits with gdc_wait before its first load), else none."""
    if device.type != "cuda" or interpreted(kernel):
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if supported(index) else {}
