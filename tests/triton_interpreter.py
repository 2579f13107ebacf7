"""Triton's interpreter for the kernel tests on a machine without a GPU, and a record of what an engine test sends
through a kernel."""
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
    sys.modules.pop("flashdraft.kernels.split_reduce_triton", None)  # kernels the kernel modules import
    kernels_cache.cache_clear()


def interpret_layer_kernels() -> None:
    """interpret_without_gpu for every kernel of a decoder layer's few-row paths: the skinny GEMM, decode attention,
    qkv_prep, the row norm and SwiGLU."""
    from flashdraft.layers import decode_attention, qkv_prep, rms_norm_rows, skinny_gemm, swiglu_rows
    for kernels, layer in (("skinny_triton", skinny_gemm), ("attention_triton", decode_attention),
                           ("qkv_prep_triton", qkv_prep), ("rms_norm_triton", rms_norm_rows),
                           ("swiglu_triton", swiglu_rows)):
        interpret_without_gpu(f"flashdraft.kernels.{kernels}", layer._kernels)


def generate_through(module, op_name: str, engine, prompt, params, ref, arg_shape) -> list | None:
    """Assert that engine's greedy output, plain, drafting 7 and drafting 3 (verify steps shorter than a block),
    equals ref. On the CPU, also return arg_shape(first argument) of every call of module.op_name (the kernel's
    entry: kernels.runtime.opaque_op) meanwhile; on CUDA None, since graph replays and compiled layers do not call
    back into Python."""
    drafts = (0, 7, 3)
    if torch.cuda.is_available():
        for draft in drafts:
            assert engine.generate(prompt, params, draft).tokens == ref
        return None
    calls = []
    real = getattr(module, op_name)
    setattr(module, op_name, lambda *a: calls.append(arg_shape(a[0])) or real(*a))
    try:
        for draft in drafts:
            assert engine.generate(prompt, params, draft).tokens == ref
    finally:
        setattr(module, op_name, real)
    return calls
