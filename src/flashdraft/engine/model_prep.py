"""What the engine decides and does about the models before running them: the plan they are built with (which
kernels the few-row passes take, resolved from the device), their weights laid out for it, and compiled decoder
layers (docs/performance.md measures each)."""
from __future__ import annotations

import torch
from torch import nn

from flashdraft.kernels.runtime import can_run, triton_available
from flashdraft.models.llama.model import DecoderLayer
from flashdraft.layers.plan import ATTENTION_BACKENDS, GEMM_BACKENDS, LayerPlan
from flashdraft.layers.skinny_gemm import BLOCK_M
from flashdraft.models.gemma4.model import Gemma4DecoderLayer


def _fast_path_default(device: torch.device, fallback: str) -> str:
    """"triton" on a CUDA device that Triton's bf16 tensor-core products run on (compute capability 8.0 and up,
    where the kernels were measured) when Triton is installed, else the fallback."""
    if device.type != "cuda" or not triton_available():
        return fallback
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
        return fallback
    return "triton"


def _resolve_backend(option: str, value: str | None, choices: tuple[str, ...], fallback: str,
                     device: torch.device) -> str:
    value = value or _fast_path_default(device, fallback)
    if value not in choices:
        raise ValueError(f"unknown {option} backend {value!r}; choose from {', '.join(choices)}")
    if value == "triton" and not can_run(device):
        raise ValueError(f"{option}='triton' needs Triton and a CUDA device (got {device.type}"
                         f"{'' if triton_available() else ', and Triton is not installed'})")
    return value


def resolve_gemm(gemm: str | None, device: torch.device) -> str:
    """The GEMM backend for the linear layers: "cublas" or "triton", which needs Triton and a CUDA device (or
    Triton's interpreter, TRITON_INTERPRET=1, as the CPU tests use). None: "triton" on CUDA where Triton is
    installed (faster at batch 1-16 and batch-invariant, docs/performance.md), else "cublas"."""
    return _resolve_backend("gemm", gemm, GEMM_BACKENDS, "cublas", device)


def resolve_attention(attention: str | None, device: torch.device) -> str:
    """The attention backend of passes of up to 16 tokens over the cache: "sdpa" or "triton"
    (flashdraft.layers.decode_attention: split-KV and batch-invariant), which needs what gemm="triton" needs.
    None: "triton" on CUDA where Triton is installed (2-3x faster than SDPA there), else "sdpa"."""
    return _resolve_backend("attention", attention, ATTENTION_BACKENDS, "sdpa", device)


def compiles(device: torch.device | str, compile: bool | None) -> bool:
    """Whether the engine compiles decoder layers: on CUDA by default."""
    return torch.device(device).type == "cuda" if compile is None else compile


def resolve_plan(device: torch.device | str, gemm: str | None = None, attention: str | None = None,
                 compile: bool | None = None, block_size: int = 1, slots: int = 1) -> LayerPlan:
    """The plan the models are built with: the backends (resolve_gemm, resolve_attention), a row limit that
    holds a verify block of `block_size` tokens for each of `slots` sequences (a batched step's passes: the
    few-row kernels compute each row as alone), and fused projections where the fused layer path or compiled
    layers use them."""
    if slots < 1:
        raise ValueError(f"slots must be at least 1, got {slots}")
    device = torch.device(device)
    gemm, attention = resolve_gemm(gemm, device), resolve_attention(attention, device)
    fused = gemm == "triton" and attention == "triton"
    return LayerPlan(gemm=gemm, attention=attention, max_rows=max(BLOCK_M, block_size * slots),
                     fuse_projections=fused or compiles(device, compile))


def compile_layers(*models: nn.Module) -> None:
    """torch.compile each decoder layer on neither fused path (regional compilation: the layers of a kind share one
    compiled graph, so compile time does not grow with depth); fuses every elementwise op of a layer around its
    GEMMs and attention. Of a DecoderLayer on a fused path (fused_forward, quant_forward) only the module path
    that longer passes take (compile_module_path): the fused paths' kernels compute each row from that row alone,
    so a one-row pass rounds exactly as a multi-row one, which a compiled Qwen3 layer did not give on the H200
    (docs/performance.md). Gemma 4's compiled layers keep that property in the GPU test
    test_gemma4_target_rows_are_bitwise_independent_of_the_block."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Past the limit dynamo would run a layer's new variant eagerly, which rounds otherwise than its compiled twin:
    # a verify pass could then disagree with plain decoding. An error that names the limit instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for model in models:
        for m in model.modules():
            if isinstance(m, DecoderLayer) and m.fused_rows:
                m.compile_module_path()
            elif isinstance(m, (DecoderLayer, Gemma4DecoderLayer)) and getattr(m, "_compiled_call_impl", None) is None:
                m.compile(dynamic=True)
