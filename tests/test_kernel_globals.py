"""Every Triton kernel of flashdraft.kernels reads only globals that Triton's compiler takes: constexprs, other
jitted functions and modules. The interpreter the CPU tests run under takes any global, so a plain float a kernel
reads passed them and failed to compile on the GPU (the GeGLU constant, 2026-12-06); this check finds such a
global on the CPU, without compiling."""
import importlib
import pkgutil
import types

import pytest

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import flashdraft.kernels  # noqa: E402

# what triton.jit gives: a kernel, or its interpreted form where an earlier test switched the interpreter on
JITTED = (JITFunction, InterpretedFunction)

PLAIN_FLOAT = 0.5
CONSTANT = triton.language.constexpr(0.5)


def plain_globals(kernel) -> list[str]:
    """The module globals a jitted function reads that are not constexprs, jitted functions or modules."""
    scope = kernel.fn.__globals__
    return [name for name in kernel.fn.__code__.co_names if name in scope
            and not isinstance(scope[name], (*JITTED, types.ModuleType, triton.language.constexpr))]


def kernels() -> list[tuple[str, object]]:
    found = []
    for info in pkgutil.iter_modules(flashdraft.kernels.__path__):
        module = importlib.import_module(f"flashdraft.kernels.{info.name}")
        found += [(f"{module.__name__}.{name}", obj) for name, obj in vars(module).items()
                  if isinstance(obj, JITTED) and obj.fn.__module__ == module.__name__]
    return found


def test_kernels_read_only_globals_the_compiler_takes():
    found = kernels()
    assert len(found) >= 10 and any(name.endswith("attention_kernel") for name, _ in found)
    assert {name: plain_globals(k) for name, k in found if plain_globals(k)} == {}


def test_a_plain_global_is_found():
    @triton.jit
    def scaled(x_ptr):
        x = triton.language.load(x_ptr)
        triton.language.store(x_ptr, x * PLAIN_FLOAT + CONSTANT)

    assert plain_globals(scaled) == ["PLAIN_FLOAT"]
