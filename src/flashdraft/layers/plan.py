"""How a model's layers run: fixed when the model is built, so a layer's code says which path a pass takes."""
from __future__ import annotations

from dataclasses import dataclass

GEMM_BACKENDS = ("cublas", "triton")
ATTENTION_BACKENDS = ("sdpa", "triton")


@dataclass(frozen=True)
class LayerPlan:
    """The kernels of the few-row passes over the cache (decode, verify, draft: at most `max_rows` rows); longer
    passes (prefill) always take F.linear and SDPA.

    gemm: "cublas" (F.linear) or "triton" (layers.skinny_gemm: batch-invariant, so a token's row of a verify pass
    is bitwise what plain decoding gives it). attention: "sdpa" or "triton" (layers.decode_attention: split-KV,
    batch-invariant). With both on Triton, decoder layers whose weights allow it run such a pass as six fused
    kernels (DecoderLayer.fused_forward). fuse_projections: one q/k/v and one gate/up GEMM per layer (the fused
    path needs them; compiled layers gain from them)."""

    gemm: str = "cublas"
    attention: str = "sdpa"
    max_rows: int = 16  # one skinny GEMM tile (skinny_gemm.BLOCK_M); the engine raises it for larger blocks
    fuse_projections: bool = False

    def __post_init__(self):
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"unknown gemm backend {self.gemm!r}; choose from {', '.join(GEMM_BACKENDS)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention!r}; choose from "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")

    @property
    def gemm_rows(self) -> int:
        """Inputs of up to this many rows take the skinny GEMM (0: none)."""
        return self.max_rows if self.gemm == "triton" else 0

    @property
    def attention_rows(self) -> int:
        """Cached passes of up to this many tokens take decode_attention (0: none)."""
        return self.max_rows if self.attention == "triton" else 0

    @property
    def fused(self) -> bool:
        """Whether decoder layers take the fused path (both Triton backends, fused projections)."""
        return self.gemm == "triton" and self.attention == "triton" and self.fuse_projections
