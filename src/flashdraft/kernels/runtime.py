"""Where the Triton kernels can run, the GPU's multiprocessor count that their tilings follow, and how a kernel's
launch becomes one op to torch.compile (opaque_op). Imports no Triton itself, so importing flashdraft never needs
it."""
from __future__ import annotations

import functools
import os
from typing import Callable

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


def interpreted(kernel) -> bool:
    """Whether this @triton.jit kernel runs under the interpreter: decided when it was decorated (its module's
    import), whatever TRITON_INTERPRET says now."""
    return type(kernel).__name__ == "InterpretedFunction"


def can_run(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run for tensors on `device`: CUDA with Triton, or Triton's interpreter."""
    device = torch.device(device)
    return triton_available() and (device.type == "cuda" or interpreting())


@functools.cache
def gpu_sm_count(device_index: int) -> int:
    """Multiprocessors of that GPU."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def opaque_op(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator: `fn` (typed, returning a tensor) as the custom op `name` inside torch.compile'd code, one opaque
    call whose output `fake` shapes (dynamo does not trace into a Triton launch), and as itself when called
    eagerly: a custom op's dispatch costs the host more than the kernel launch it wraps, and eager passes of a
    few rows are bound by the host (docs/performance.md)."""
    def wrap(fn: Callable) -> Callable:
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return op(*args, **kwargs) if torch.compiler.is_compiling() else fn(*args, **kwargs)
        return call
    return wrap
