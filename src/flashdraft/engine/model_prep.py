"""What the engine does to the models it is given before running them, on CUDA by default: fused q/k/v and
gate/up projections, and compiled decoder layers (docs/performance.md measures each)."""
from __future__ import annotations

import torch
from torch import nn

from flashdraft.layers import DecoderLayer, RMSNorm
from flashdraft.models.gemma4 import Gemma4DecoderLayer


def fuse_projections(*models: nn.Module) -> None:
    """Fused q/k/v and gate/up weights: fewer, larger GEMMs per layer (views, so no memory is added)."""
    for model in models:
        for m in model.modules():
            if hasattr(m, "fuse_projections") and getattr(m, "qkv_weight", None) is None \
                    and getattr(m, "gate_up_weight", None) is None \
                    and all(type(c) is nn.Linear for c in m.children() if not isinstance(c, RMSNorm)):
                m.fuse_projections()  # plain float Linear layers only: quantized blocks stay as they are


def compile_layers(*models: nn.Module) -> None:
    """torch.compile each decoder layer (regional compilation: the layers of a kind share one compiled graph, so
    compile time does not grow with depth); fuses every elementwise op of a layer around its GEMMs and attention.
    Gemma 4's layers are the costliest case left uncompiled: about 60 small norm/RoPE/cache kernels each."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for model in models:
        for m in model.modules():
            if isinstance(m, (DecoderLayer, Gemma4DecoderLayer)) and getattr(m, "_compiled_call_impl", None) is None:
                m.compile(dynamic=True)
