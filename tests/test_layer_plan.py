"""The plan models are built with (layers.plan.LayerPlan), as the engine resolves it (engine.model_prep)."""
import pytest
import torch

from flashdraft.engine.generator import Engine
from flashdraft.engine.model_prep import resolve_plan
from flashdraft.layers import LayerPlan
from flashdraft.models import load_model


def test_resolve_plan_on_the_cpu():
    """The CPU default: cuBLAS-style F.linear and SDPA, no fused projections unless layers are compiled, and a
    row limit that holds the verify block."""
    assert resolve_plan("cpu") == LayerPlan("cublas", "sdpa", 16, False)
    assert resolve_plan("cpu", compile=True).fuse_projections
    assert resolve_plan("cpu", block_size=32).max_rows == 32 and resolve_plan("cpu", block_size=8).max_rows == 16
    plan = LayerPlan("triton", "sdpa", 24)
    assert (plan.gemm_rows, plan.attention_rows, plan.fused) == (24, 0, False)
    assert LayerPlan("triton", "triton", 16, True).fused and not LayerPlan("triton", "triton", 16, False).fused
    for bad, words in ((dict(gemm="cutlass"), "unknown gemm"), (dict(attention="flash"), "unknown attention"),
                       (dict(max_rows=0), "max_rows")):
        with pytest.raises(ValueError, match=words):
            LayerPlan(**bad)


def test_the_engine_refuses_a_plan_whose_rows_do_not_hold_the_block(qwen3_dir, drafter_dir):
    """Passes longer than the plan's rows would leave the batch-invariant kernels, and greedy DFlash could part
    from plain decoding on a GPU: models built for fewer rows than a verify block are refused."""
    loaded = load_model(qwen3_dir, drafter_dir, device="cpu", dtype=torch.float32, context_size=64,
                        plan=LayerPlan(gemm="triton", max_rows=4))
    with pytest.raises(ValueError, match="passes of up to 4 rows"):
        Engine(loaded.target, None, loaded.drafter, context_size=64)
    plain_rows = load_model(qwen3_dir, drafter_dir, device="cpu", dtype=torch.float32, context_size=64,
                            plan=LayerPlan(max_rows=4))  # no Triton backend: no row limit to hold
    assert Engine(plain_rows.target, None, plain_rows.drafter, context_size=64).decoder.block_size > 4
