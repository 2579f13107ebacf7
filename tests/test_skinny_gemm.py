"""The batch-invariant skinny GEMM (flashdraft.layers.skinny_gemm): its Triton kernel under Triton's interpreter
on the CPU (skipped without Triton), the config choice, the custom op, and the engine's gemm option.

On a CUDA machine the kernel tests run the compiled kernel instead (the interpreter is only switched on here
when no GPU is present); scripts/gpu/gemm_run.py checks the GPU kernel at the real shapes.
"""

import dataclasses

import pytest
import torch
from torch import nn

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

pytest.importorskip("triton")

from triton_interpreter import generate_through, interpret_without_gpu  # noqa: E402

from flashdraft.layers import skinny_gemm as sg  # noqa: E402

interpret_without_gpu("flashdraft.kernels.skinny_triton", sg._kernels)


# (n, k, config): the heuristic's pick, uneven N and K (masked edges), split-K (the deterministic reduce
# kernel, an uneven split too), the swapped operand order.
CASES = [
    (96, 256, None),
    (80, 200, None),
    (64, 512, sg.SkinnyConfig(16, 64, split_k=2)),
    (72, 200, sg.SkinnyConfig(32, 64, split_k=4, swap=True)),
    (64, 256, sg.SkinnyConfig(32, 64, swap=True)),
    (48, 160, sg.SkinnyConfig(16, 32, split_k=3)),
    (64, 256, sg.SkinnyConfig(32, 64, swap=True, block_m=64)),
]


def _tol(dtype):
    # bf16 output rounding (the interpreter truncates fp32 -> bf16 instead of rounding: up to 2 ** -7)
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,config", CASES)
def test_matches_float64_product_and_is_batch_invariant(n, k, config, dtype):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    x = torch.randn(16, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    y = sg.launch(x, w, b, config)
    assert y.shape == (16, n) and y.dtype == dtype
    ref = x.double() @ w.double().T + b.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < _tol(dtype)
    # Bitwise: the rows of a 16-row product are those of 1-, 3- and 7-row products of the same inputs.
    for m in (1, 3, 7):
        assert torch.equal(sg.launch(x[:m], w, b, config), y[:m])
    # and a row does not depend on what the other rows hold
    other = x.clone()
    other[1:] = torch.randn(15, k, generator=g).to(DEVICE, dtype)
    assert torch.equal(sg.launch(other, w, b, config)[0], y[0])
    no_bias = sg.launch(x[:2], w, None, config)
    ref_nb = x[:2].double() @ w.double().T
    assert ((no_bias.double() - ref_nb).abs().max() / ref_nb.abs().max()).item() < _tol(dtype)


def test_more_than_16_rows_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g).to(DEVICE)
    x = torch.randn(2, 20, 96, generator=g).to(DEVICE)
    y = sg.skinny_linear(x, w)
    assert y.shape == (2, 20, 64)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-4)
    flat = x.reshape(40, 96)
    assert torch.equal(sg.skinny_linear(flat[16:32], w), y.reshape(40, 64)[16:32])  # still tile by tile
    assert sg.skinny_linear(x[:, :0], w).shape == (2, 0, 64)


def test_stages_fit_the_shared_memory():
    """The pipelining depth drops where a stage's weight and x tiles would pass the shared memory: 64-row tiles
    add four times the x of 16-row ones to every stage, and the gated product a second weight tile."""
    qkv = sg.config_for(6144, 4096)
    assert sg.stages_for(qkv, 2, False) == qkv.num_stages == 6
    # 64 x 128 weight tile plus 64 x 128 of x: 32 KiB a stage, 6 still fit in 200 KiB; with the up rows 48 KiB, 4
    assert sg.stages_for(sg.tiling_for_rows(qkv, 64), 2, False) == 6
    assert sg.stages_for(sg.tiling_for_rows(qkv, 64), 2, True) == 4
    wide = sg.SkinnyConfig(64, 256, 1, 4, 6, swap=True, block_m=64)
    assert sg.stages_for(wide, 2, False) == 3 and sg.stages_for(wide, 4, True) == 2


def test_batched_passes_take_the_batch_tiles_past_16_rows():
    """A tiling with batch_block_m runs its own tiles up to 16 rows and the wider ones past: the shapes measured
    for it (Qwen3-8B's, and its gate/up's gated product) have it, others keep one tile height."""
    wide = sg.CONFIGS[(4096, 12288)]
    assert wide.batch_block_m == 64 and wide.block_m == 16 and wide.name == "n64k128s1w4p6xb64"
    assert sg.tiling_for_rows(wide, 16) is wide
    assert sg.tiling_for_rows(wide, 17) == dataclasses.replace(wide, block_m=64, batch_block_m=0)
    assert sg.GATED_CONFIGS[(24576, 4096)].batch_block_m == 64
    assert sg.tiling_for_rows(sg.config_for(300, 100), 64) == sg.config_for(300, 100)
    # what the kernel runs: a 40-row pass in one 64-row tile gives the product within the rounding of bf16
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g).to(DEVICE, torch.bfloat16)
    x = torch.randn(40, 256, generator=g).to(DEVICE, torch.bfloat16)
    tiled = sg.SkinnyConfig(32, 64, swap=True, batch_block_m=64)
    y = sg.launch(x, w, None, tiled)
    ref = x.double() @ w.double().T
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < _tol(torch.bfloat16)


# Every tiling the tables adopt, at its shape and with the fusions the fused layers give it (name: (weight rows,
# K, fusion)); on the GPU only (the shapes are Qwen3-8B's)
ADOPTED = {"q/k/v + norm": (6144, 4096, "norm"), "o + residual": (4096, 4096, "residual"),
           "gate/up + norm + SwiGLU": (24576, 4096, "norm+gated"), "down + residual": (4096, 12288, "residual"),
           "LM head": (151936, 4096, ""), "drafter fc": (4096, 20480, "")}


@pytest.mark.skipif(not ON_CUDA, reason="the adopted tilings' bits are the GPU's tensor cores'")
@pytest.mark.parametrize("name", sorted(ADOPTED))
def test_adopted_tilings_give_each_row_its_bits_alone_at_every_row_count(name):
    """Each row of a pass of 2 to 64 rows (the 16-row tiles of a verify step, the 64-row ones of a batched step)
    bitwise equal to the same row alone, at the model's tiling for its shape (lossless DFlash on the GPU rests on
    it: a verify step's rows are decode steps' rows)."""
    rows, k, fusion = ADOPTED[name]
    n = rows // 2 if "gated" in fusion else rows
    g = torch.Generator(device="cuda").manual_seed(rows + k)
    w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16, generator=g)
    residual = torch.randn(64, n, device="cuda", dtype=torch.bfloat16, generator=g) if "residual" in fusion else None
    eps = 1e-6 if "norm" in fusion else None

    def run(first, m):
        return sg.launch(x[first:first + m], w, None, rms_norm_eps=eps, gated="gated" in fusion,
                         residual=None if residual is None else residual[first:first + m])

    alone = torch.cat([run(i, 1) for i in range(64)])
    for m in (2, 7, 16, 17, 40, 64):
        assert torch.equal(run(0, m), alone[:m]), (name, m)


def test_a_broken_kernel_is_caught(monkeypatch):
    """The checks above can fail: a kernel whose K steps depend on M is caught by the invariance check."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 512, generator=g).to(DEVICE)
    x = torch.randn(16, 512, generator=g).to(DEVICE)
    real = sg.launch

    def m_dependent(x, w, b=None, config=None):
        config = sg.SkinnyConfig(16, 128 if x.shape[0] > 1 else 32, split_k=1 if x.shape[0] > 1 else 2)
        return real(x, w, b, config)

    rows = [m_dependent(x[i:i + 1], w)[0] for i in range(16)]
    assert not all(torch.equal(r, y) for r, y in zip(rows, m_dependent(x, w)))


def test_config_is_chosen_by_shape_not_rows():
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (4096, 20480),
                 (1024, 4096), (28672, 4096), (4096, 14336), (2048, 6144), (300, 100)]:
        c = sg.config_for(n, k)
        assert c == sg.config_for(n, k)  # deterministic
        assert c.block_n in (16, 32, 64) and c.split_k in (1, 2, 4) and not c.pdl
        assert c in sg.candidate_configs(n, k)
    assert sg.config_for(4096, 4096) == sg.CONFIGS[(4096, 4096)]


def test_custom_op_registration_and_compile():
    """The op has a fake implementation (opcheck) and works inside torch.compile with a dynamic row count."""
    w = torch.randn(32, 64).to(DEVICE)
    x = torch.randn(3, 64).to(DEVICE)
    torch.library.opcheck(torch.ops.flashdraft.skinny_linear.default, (x, w, None),
                          test_utils=("test_schema", "test_faketensor"))

    def f(x):
        return sg.linear(x, w, None, 16).relu()

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for m in (1, 5, 16):
        assert torch.equal(compiled(x.repeat(6, 1)[:m]), f(x.repeat(6, 1)[:m]))


def test_layers_take_the_gemm_of_their_plan():
    """Layers built with LayerPlan(gemm="triton") send products of up to max_rows rows to the kernel (plain and
    fused projections alike) and larger ones to F.linear; built with the default plan, none."""
    from flashdraft.config import ModelConfig
    from flashdraft.layers import Attention, LayerPlan
    from flashdraft.models.llama.model import GatedMLP
    cfg = ModelConfig.from_dict(dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=16, max_position_embeddings=64))
    plan = LayerPlan(gemm="triton", max_rows=16)
    model = nn.Sequential(Attention(cfg, plan), GatedMLP(32, 64, plan=plan),
                          sg.Linear(32, 8, max_rows=plan.gemm_rows)).to(DEVICE)
    assert model[0].q_proj.max_rows == model[1].gate_proj.max_rows == model[1].down_proj.max_rows == 16
    calls = []
    real = sg._skinny_linear
    try:
        sg._skinny_linear = lambda *a: calls.append(a[0].shape) or real(*a)
        x = torch.randn(4, 32, device=DEVICE)
        model[2](x)
        model[2](torch.randn(17, 32, device=DEVICE))  # more rows than max_rows: F.linear
        model[1].fuse_projections()
        assert model[1].gate_up_proj.max_rows == 16
        model[1](x)
        default = nn.Sequential(GatedMLP(32, 64), sg.Linear(32, 8)).to(DEVICE)
        default[0](x), default[1](x)
    finally:
        sg._skinny_linear = real
    assert calls == [(4, 32), (4, 32), (4, 64)]  # lm-head-like layer, fused gate/up, down; the default plan: none
    with pytest.raises(ValueError, match="unknown gemm"):
        LayerPlan(gemm="cutlass")


def test_engine_gemm_option(qwen3_dir, drafter_dir):
    """gemm="triton" routes the target's and drafter's layers through the kernel, and greedy output (plain
    and DFlash) equals the cuBLAS/F.linear engine's on this tiny float32 model."""
    from flashdraft.config import SamplingParams
    from flashdraft.engine.generator import Engine

    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompt = list(range(3, 19))
    load = dict(device=DEVICE, dtype=torch.float32, context_size=64)
    plain = Engine.load(qwen3_dir, drafter_dir, gemm="cublas", attention="sdpa", **load)
    assert plain.decoder.plan.gemm == "cublas" and plain.decoder.target.lm_head.max_rows == 0
    ref = plain.generate(prompt, params, 0).tokens
    eng = Engine.load(qwen3_dir, drafter_dir, gemm="triton", attention="sdpa", **load)
    assert eng.decoder.plan.gemm == "triton"
    rows = max(16, eng.decoder.block_size)
    assert eng.decoder.target.lm_head.max_rows == eng.decoder.drafter.fc.max_rows == rows
    assert eng.decoder.target.model.layers[0].mlp.down_proj.max_rows == rows
    calls = generate_through(sg, "_skinny_linear", eng, prompt, params, ref, lambda x: tuple(x.shape))
    if calls is None:
        return
    assert (1, 64) in calls and (8, 64) in calls  # decode steps and drafter blocks/verify went through it
    assert all(shape[0] <= 16 for shape in calls)  # the 16-token prompt's prefill too (<= max_m), never more


def test_engine_rejects_triton_where_it_cannot_run(monkeypatch, qwen3_dir):
    from flashdraft.engine.model_prep import resolve_gemm
    assert resolve_gemm(None, torch.device("cpu")) == "cublas"
    with pytest.raises(ValueError, match="unknown gemm"):
        resolve_gemm("fast", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs Triton and a CUDA device"):
        resolve_gemm("triton", torch.device("cpu"))
