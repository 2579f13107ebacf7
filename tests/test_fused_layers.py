"""The fused decoder-layer path (DecoderLayer.fused_forward: norms in GEMM prologues, residual adds and SwiGLU in
GEMM epilogues, layers.qkv_prep, decode_attention), which few-row passes take when both Triton backends are on:
against the module-by-module path, and through the engine (greedy DFlash equal to plain decoding, pipelined and
graphed through the CPU stand-in). Triton's interpreter runs the kernels on the CPU."""
import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

pytest.importorskip("triton")

from triton_interpreter import interpret_layer_kernels  # noqa: E402

from flashdraft.config import SamplingParams  # noqa: E402
from flashdraft.engine.generator import Engine  # noqa: E402
from flashdraft.layers import LayerPlan  # noqa: E402
from flashdraft.models.llama.model import DecoderLayer  # noqa: E402
from flashdraft.models import load_model  # noqa: E402
from test_lossless import InlineGraphs, logging_oracle, without_warm_up_repeats  # noqa: E402
from tiny_models import build_drafter, build_target  # noqa: E402

interpret_layer_kernels()

FUSED = LayerPlan(gemm="triton", attention="triton", fuse_projections=True)


def _layer_pass(target, T: int = 5, start: int = 20):
    """A cached pass of T random rows at positions start.. for one of target's layers: (h, cos, sin, positions,
    kv_len, mask, history), history the random keys and values of a 32-row cache before it."""
    positions = torch.arange(start, start + T, device=DEVICE)
    cos, sin = target.rope(positions)
    kv_len = start + T
    mask = torch.arange(kv_len, device=DEVICE)[None, :] <= positions[:, None]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, target.config.hidden_size, generator=g).to(DEVICE)
    history = [torch.randn(target.config.num_key_value_heads, 32, target.config.head_dim, generator=g).to(DEVICE)
               for _ in range(2)]
    return h, cos, sin, positions, kv_len, mask, history


def _run_paths(runs, h, cos, sin, positions, kv_len, mask, history):
    """Each of a layer's paths over the same pass, each from the same cache: the outputs, and the caches after."""
    outs, caches = [], []
    for run in runs:
        cache_k, cache_v = history[0].clone(), history[1].clone()
        with torch.inference_mode():
            outs.append(run(h, cos, sin, cache_k, cache_v, positions, kv_len, mask))
        caches.append((cache_k, cache_v))
    return outs, caches


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # with and without per-head q/k norm
def test_fused_forward_matches_the_module_path(tmp_path, family):
    """One layer's fused path (norm weights folded into the projections) against the module path of the same
    folded model and of the checkpoint as loaded: outputs and written cache rows."""
    folder = build_target(tmp_path / family, family=family, seed=4)
    original = load_model(folder, device=DEVICE, dtype=torch.float32, context_size=64).target
    target = load_model(folder, device=DEVICE, dtype=torch.float32, context_size=64, plan=FUSED).target
    target.prepare()
    assert all(layer.fused_rows == 16 for layer in target.model.layers)
    layer = target.model.layers[1]
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))  # folded
    h, cos, sin, positions, kv_len, mask, history = _layer_pass(target)
    # the fused path, the module path of the same folded weights, the checkpoint as loaded
    outs, caches = _run_paths((layer.forward, layer.module_forward, original.model.layers[1].forward),
                              h, cos, sin, positions, kv_len, mask, history)
    for out, cache in zip(outs[1:], caches[1:]):
        torch.testing.assert_close(outs[0], out, rtol=1e-4, atol=1e-4)
        for fused_cache, module_cache in zip(caches[0], cache):
            torch.testing.assert_close(fused_cache, module_cache, rtol=1e-5, atol=1e-5)
            before = positions[0]  # rows before the pass untouched
            assert torch.equal(fused_cache[:, :before], module_cache[:, :before])
    assert not torch.allclose(outs[0], h, atol=1e-3)  # the layer really did something


def test_the_fused_path_needs_its_plan_and_prepared_weights(tmp_path):
    """A layer takes the fused path only when its plan says so (both Triton backends, fused projections) and
    prepare() has laid its weights out; prepare is done once, however often it is called."""
    folder = build_target(tmp_path / "t", family="qwen3")
    for plan, rows in ((FUSED, 8), (LayerPlan(gemm="triton", attention="triton"), 0),
                       (LayerPlan(gemm="triton", fuse_projections=True), 0)):
        target = load_model(folder, device=DEVICE, dtype=torch.float32, context_size=64,
                            plan=LayerPlan(plan.gemm, plan.attention, 8, plan.fuse_projections)).target
        layers = [layer for layer in target.modules() if isinstance(layer, DecoderLayer)]
        assert all(layer.fused_rows == 0 for layer in layers)  # not prepared yet
        target.prepare()
        fused = layers[0].self_attn.qkv_proj
        weight = fused.weight.clone() if fused is not None else None
        target.prepare()
        assert all(layer.fused_rows == rows for layer in layers)
        assert (weight is not None) == plan.fuse_projections
        assert weight is None or torch.equal(weight, layers[0].self_attn.qkv_proj.weight)  # norms folded in once


def _randomize_norms(folder):
    """Norm weights other than ones (as trained checkpoints have), so that folding them into the projections shows."""
    from safetensors.torch import load_file, save_file
    path = folder / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(("layernorm.weight", "hidden_norm.weight")):
            tensors[name] = (0.5 + torch.rand(t.shape, generator=g)).to(t.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def test_engine_fused_path_is_lossless(tmp_path):
    """Both Triton backends: the layers take the fused path, are not compiled, and plain steps are not padded;
    greedy DFlash equals plain decoding, eager and pipelined through the graph stand-in, and both equal the
    cuBLAS / SDPA engine on this float32 model."""
    target_dir = build_target(tmp_path / "t", family="qwen3", layers=2, seed=6)
    drafter_dir = build_drafter(tmp_path / "d", target_dir, block_size=4, seed=6)
    for folder in (target_dir, drafter_dir):
        _randomize_norms(folder)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = list(range(5, 25))  # prefilled on the module path (more rows than the fused path takes)
    load = dict(device=DEVICE, dtype=torch.float32, context_size=64)
    unfused = Engine.load(target_dir, drafter_dir, gemm="cublas", attention="sdpa", **load)
    ref = unfused.generate(prompt, params, 0).tokens
    guesses = {"unfused": [], "fused": []}  # the drafter's own guesses, step by step
    # the logging oracle syncs with the host, which a captured step cannot
    logged = unfused.new_sequence(oracle=None if ON_CUDA else logging_oracle(guesses["unfused"]))
    assert unfused.generate(prompt, params, 3, sequence=logged).tokens == ref
    engine = Engine.load(target_dir, drafter_dir, gemm="triton", attention="triton", **load)
    decoder = engine.decoder
    assert decoder.fused_target and not decoder.compiled and decoder._plain_rows() == 1
    assert all(layer.fused_rows == 16 for layer in decoder.drafter.layers)
    assert engine.generate(prompt, params, 0).tokens == ref
    if not ON_CUDA:
        decoder.graphs = InlineGraphs()
    if ON_CUDA:  # tokens only (no logging oracle there)
        assert engine.generate(prompt, params, 3).tokens == ref
        return
    logged = engine.new_sequence(oracle=logging_oracle(guesses["fused"]))
    assert engine.generate(prompt, params, 3, sequence=logged).tokens == ref
    # the fused drafter guesses what the unfused one does: its context keys and values too (unfolded k/v weights)
    fused = without_warm_up_repeats(guesses["fused"])
    assert fused == guesses["unfused"] and len(fused) >= 2
    assert ON_CUDA or "step" in decoder.graphs.keys  # pipelined


def _assert_same_context_rows(drafter, module_path, tol: float) -> None:
    """The same five context rows (taps at scattered positions) through both drafters' add_context: each writes the
    same keys and values (within tol) at those cache rows and nothing elsewhere."""
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(5, drafter.fc.in_features, generator=g).to(DEVICE)
    positions = torch.tensor([9, 3, 4, 20, 11], device=DEVICE)
    caches = []
    for d in (drafter, module_path):
        cache = d.new_cache(32)
        for t in (*cache.k, *cache.v):
            t.fill_(float("nan"))
        d.add_context(taps, positions, cache)
        caches.append(cache)
    written = torch.zeros(32, dtype=torch.bool, device=DEVICE)
    written[positions] = True
    for rows, module in zip((*caches[0].k, *caches[0].v), (*caches[1].k, *caches[1].v)):
        assert rows[:, ~written].isnan().all()
        torch.testing.assert_close(rows[:, written], module[:, written], rtol=tol, atol=tol)


def test_drafter_context_projection_fused(tmp_path):
    """A step's context rows through the drafter's fused projection (fc, then per layer one GEMM with hidden_norm
    folded into the [k; v] weights and qkv_prep without query heads) write the keys and values the module path
    writes, at the same rows only."""
    target_dir = build_target(tmp_path / "t", family="qwen3", layers=2, seed=7)
    drafter_dir = build_drafter(tmp_path / "d", target_dir, block_size=4, seed=7)
    _randomize_norms(drafter_dir)
    engine = Engine.load(target_dir, drafter_dir, device=DEVICE, dtype=torch.float32, context_size=64, gemm="triton",
                         attention="triton")
    module_path = load_model(target_dir, drafter_dir, device=DEVICE, dtype=torch.float32, context_size=64).drafter
    fused = engine.decoder.drafter
    assert fused.context_fused_rows == 16 and len(fused.context_kv) == len(fused.layers)
    assert module_path.context_fused_rows == 0
    _assert_same_context_rows(fused, module_path, tol=1e-5)


def test_engines_keep_the_plan_their_models_were_built_with(tmp_path):
    """Engines built one after another over the same models (the synthetic benchmark's baseline and DFlash) find
    them prepared once (the drafter's [k; v] context weights made once); models of different plans are refused."""
    target_dir = build_target(tmp_path / "t", family="qwen3", layers=2, seed=8)
    drafter_dir = build_drafter(tmp_path / "d", target_dir, block_size=4, seed=8)
    loaded = load_model(target_dir, drafter_dir, device=DEVICE, dtype=torch.float32, context_size=64, plan=FUSED)
    target, drafter = loaded.target, loaded.drafter
    Engine(target, None, drafter, context_size=64)
    weights = [w.clone() for w, _ in drafter.context_kv]
    Engine(target, None, None, context_size=64)
    Engine(target, None, drafter, context_size=64)
    assert drafter.context_fused_rows == 16 and len(drafter.context_kv) == len(drafter.layers)
    assert all(torch.equal(a, w) for a, (w, _) in zip(weights, drafter.context_kv))
    other = load_model(target_dir, drafter_dir, device=DEVICE, dtype=torch.float32, context_size=64).drafter
    with pytest.raises(ValueError, match="different plans"):
        Engine(target, None, other, context_size=64)


def _gguf_target(tmp_path, seed):
    """A Qwen3 target (rows of whole 256-weight K-quant blocks) as a Q4_K_S-recipe GGUF: layer 0's attn_v is Q5_K,
    so its q and k are one product and v another, layer 1's q/k/v are one; and the folder it came from."""
    from test_gguf import QUANT_CASES, target_to_gguf

    folder = build_target(tmp_path / "t", family="qwen3", layers=2, hidden=256, seed=seed)
    _randomize_norms(folder)
    return target_to_gguf(folder, tmp_path / "t.gguf", QUANT_CASES["Q4_K_S"][0]), folder


def test_quant_forward_matches_the_module_path(tmp_path, record_values_apart):
    """Layers with GGUF projections take quant_forward under the fused plan (norms kept, not folded into blocks):
    outputs and cache rows as the module path's, with q/k/v as two products (q|k and a v of another type: layer 0,
    whose v qkv_prep reads apart, not copied beside q|k) and as one (layer 1); SwiGLU as one kernel, the residual
    with down_proj's product."""
    from flashdraft.layers import attention as attention_module
    from flashdraft.quant.linear import QuantLinear

    values_apart = record_values_apart(attention_module)

    path, _ = _gguf_target(tmp_path, seed=9)
    target = load_model(path, device=DEVICE, dtype=torch.float32, context_size=64, plan=FUSED).target
    target.prepare()
    layers = target.model.layers
    assert all(layer.fused_rows == 16 and not layer.norms_folded for layer in layers)
    assert layers[0].self_attn.qkv_proj is None and isinstance(layers[0].self_attn.qk_proj, QuantLinear)
    assert isinstance(layers[1].self_attn.qkv_proj, QuantLinear) and layers[1].self_attn.qk_proj is None
    attn = layers[0].self_attn
    assert attn.k_proj.blocks.data_ptr() == attn.qk_proj.blocks[attn.q_proj.out_features:].data_ptr()  # views
    h, cos, sin, positions, kv_len, mask, history = _layer_pass(target)
    for i, layer in enumerate(layers):
        values_apart.clear()
        outs, caches = _run_paths((layer.forward, layer.module_forward), h, cos, sin, positions, kv_len, mask, history)
        assert values_apart and all(apart == (i == 0) for apart in values_apart), (i, values_apart)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(outs[0], h, atol=1e-3)
        for quant_cache, module_cache in zip(*caches):
            torch.testing.assert_close(quant_cache, module_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("types", [(None, None), ("q5_0", "q4_1")], ids=["float-cache", "walkthrough-types"])
def test_engine_quant_path_is_lossless(tmp_path, types):
    """A GGUF target and drafter under both Triton backends: their layers take quant_forward and are not compiled
    (a compiled layer gave a token other bits in a verify block than alone on the H200), plain steps are one row;
    greedy DFlash equals plain decoding, eager and pipelined through the graph stand-in, and the cuBLAS / SDPA
    engine; also with the walkthrough's cache types, which qkv_prep quantizes as it writes them."""
    from test_gguf import drafter_to_gguf

    path, folder = _gguf_target(tmp_path, seed=10)
    drafter_dir = drafter_to_gguf(build_drafter(tmp_path / "d", folder, block_size=4, seed=10), tmp_path / "d.gguf",
                                  "upstream", lambda name: "Q8_0")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = list(range(5, 25))
    load = dict(device=DEVICE, dtype=torch.float32, context_size=64, cache_type_k=types[0], cache_type_v=types[1])
    ref = Engine.load(path, drafter_dir, gemm="cublas", attention="sdpa", **load).generate(prompt, params, 0).tokens
    engine = Engine.load(path, drafter_dir, gemm="triton", attention="triton", **load)
    decoder = engine.decoder
    assert decoder.fused_target and decoder._plain_rows() == 1
    assert types[0] is None or engine.new_sequence().target_cache.k[0].dtype == torch.uint8
    # the drafter's GGUF layers take quant_forward too, and its context rows the [k; v] rows of their blocks
    drafter = decoder.drafter
    assert all(layer.fused_rows == 16 and not layer.norms_folded for layer in drafter.layers)
    assert drafter.context_fused_rows == 16 and len(drafter.context_kv_blocks) == len(drafter.layers)
    assert not any(getattr(m, "_compiled_call_impl", None) for m in decoder.target.modules())
    assert engine.generate(prompt, params, 0).tokens == ref
    if not ON_CUDA:
        decoder.graphs = InlineGraphs()
    assert engine.generate(prompt, params, 3).tokens == ref
    assert ON_CUDA or "step" in decoder.graphs.keys  # pipelined


def test_drafter_context_projection_quantized(tmp_path):
    """A GGUF drafter's context rows on the quantized path (fc, hidden_norm as one kernel, per layer one product of
    the [k; v] rows of its fused q/k/v blocks, a view of them, and qkv_prep without query heads) write the keys and
    values the module path writes, at the same rows only."""
    from test_gguf import drafter_to_gguf

    _, folder = _gguf_target(tmp_path, seed=12)
    drafter_dir = build_drafter(tmp_path / "d", folder, block_size=4, seed=12)
    _randomize_norms(drafter_dir)
    path = drafter_to_gguf(drafter_dir, tmp_path / "d.gguf", "upstream", lambda name: "Q8_0")
    load = dict(device=DEVICE, dtype=torch.float32, context_size=64)
    quantized = Engine.load(folder, path, gemm="triton", attention="triton", **load).decoder.drafter
    module_path = load_model(folder, path, **load).drafter
    assert quantized.context_fused_rows == 16 and not quantized.context_kv
    assert module_path.context_fused_rows == 0
    for layer, project in zip(quantized.layers, quantized.context_kv_blocks):
        attn = layer.self_attn
        assert project.blocks.data_ptr() == attn.k_proj.blocks.data_ptr()  # k's rows, then v's: a view
        assert project.out_features == attn.k_proj.out_features + attn.v_proj.out_features
    _assert_same_context_rows(quantized, module_path, tol=1e-4)


@pytest.mark.skipif(not ON_CUDA, reason="bitwise batch invariance is the GPU kernels' property")
def test_gguf_target_rows_are_bitwise_independent_of_the_block(tmp_path):
    """What lossless greedy DFlash rests on for a Qwen3 GGUF target, in bf16 as the engine builds it: a token's
    logits are the same bits verified inside a 16-token block as decoded alone (its compiled layers failed this on
    the H200; scripts/gpu/invariance_check.py does the same on a full-size file)."""
    path, _ = _gguf_target(tmp_path, seed=11)
    target = Engine.load(path, device="cuda", dtype=torch.bfloat16, context_size=128).decoder.target
    start, n = 37, 16
    ids = torch.randint(0, target.config.vocab_size, (start + n,), generator=torch.Generator().manual_seed(2)).cuda()
    cache = target.new_cache(start + 64)
    kv = start + 32
    with torch.inference_mode():
        target(ids[:start], torch.arange(start, device="cuda"), cache, start)
        block = target(ids[start:], torch.arange(start, start + n, device="cuda"), cache, kv)[0]
        alone = [target(ids[start + i:start + i + 1], torch.tensor([start + i], device="cuda"), cache, kv)[0]
                 for i in range(n)]
    assert all(torch.equal(block[i], row[0]) for i, row in enumerate(alone))


def test_compile_layers_compiles_only_the_module_path_of_a_fused_layer(tmp_path, monkeypatch):
    """compile_layers leaves a fused layer's few-row path uncompiled (its kernels are batch-invariant, a compiled
    layer's were not) and compiles the module path that longer passes (prefill) take: a pass within fused_rows does
    not reach what torch.compile returned, a longer one does, with the module path's output and cache rows.
    (torch.compile is a recording stand-in here: Inductor on the CPU would take most of a minute.)"""
    from flashdraft.engine.model_prep import compile_layers

    compiled_rows = []

    def recording_compile(fn, **kwargs):
        assert kwargs == {"dynamic": True}

        def run(layer, h, *args):
            compiled_rows.append(h.shape[0])
            return fn(layer, h, *args)
        return run

    folder = build_target(tmp_path / "q", family="qwen3", seed=4)
    target = load_model(folder, device=DEVICE, dtype=torch.float32, context_size=64, plan=FUSED).target
    target.prepare()
    monkeypatch.setattr(torch, "compile", recording_compile)
    compile_layers(target)
    compile_layers(target)  # once
    layer = target.model.layers[1]
    assert layer.fused_rows == 16 and getattr(layer, "_compiled_call_impl", None) is None
    for T, start in ((5, 20), (20, 10)):
        h, cos, sin, positions, kv_len, mask, history = _layer_pass(target, T=T, start=start)
        outs, caches = _run_paths((layer.forward, layer.module_forward), h, cos, sin, positions, kv_len, mask, history)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
        for a, b in zip(*caches):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert compiled_rows == [20]
