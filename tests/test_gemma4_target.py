"""Our Gemma 4 target against transformers' Gemma4 implementation; one test per Gemma-specific detail."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from test_gemma4_tiny import build_gemma4_target, reference_logits

from flashdraft.config import ConfigError
from flashdraft.models.gemma4.config import Gemma4Config
from flashdraft.models import load_target
from flashdraft.models.gemma4.model import Gemma4RMSNorm, RING_OVERHANG, embedding_scale, rope_inverse_frequencies
from flashdraft.models.llama.model import GatedMLP

WINDOW = 8
LONG = WINDOW + RING_OVERHANG + 30  # past the sliding window and past one turn of the ring buffer


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(folder, transformers model, our model): dense layout, config in the published checkpoints' spelling."""
    folder, hf = build_gemma4_target(tmp_path_factory.mktemp("gemma4_dense"), moe=False, window=WINDOW)
    return folder, hf, load_target(folder, 0, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The 26B-A4B layout (router, experts, shared MLP), config in the per_layer_config spelling."""
    folder, hf = build_gemma4_target(tmp_path_factory.mktemp("gemma4_moe"), moe=True, published_spelling=False,
                                     seed=5, window=WINDOW)
    return folder, hf, load_target(folder, 0, device="cpu", dtype=torch.float32)


def _ids(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_text(hf):
    return hf.model.language_model


@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_logits_match_transformers(request, layout):
    _, hf, ours = request.getfixturevalue(layout)
    ids = _ids(LONG, ours.config.vocab_size)
    ref = reference_logits(hf, ids.tolist())
    with torch.no_grad():
        full, _ = ours(ids, torch.arange(LONG), ours.new_cache(LONG + 8), LONG)
        assert (full - ref).abs().max().item() < 1e-4
        cache, parts = ours.new_cache(LONG + 8), []
        parts.append(ours(ids[:20], torch.arange(20), cache, 20)[0])
        for i in range(20, LONG, 7):  # decoding in blocks through the static caches and the ring
            j = min(i + 7, LONG)
            parts.append(ours(ids[i:j], torch.arange(i, j), cache, j)[0])
    assert (torch.cat(parts) - ref).abs().max().item() < 1e-4


def test_sliding_ring_rollback_is_exact(dense):
    """Verify blocks whose tail is rejected leave stale rows in the ring; masking by stored position hides them."""
    _, hf, ours = dense
    ids = _ids(LONG, ours.config.vocab_size, seed=1)
    ref = reference_logits(hf, ids.tolist())
    junk = _ids(LONG, ours.config.vocab_size, seed=2)
    cache, got = ours.new_cache(LONG + 16), []
    with torch.no_grad():
        got.append(ours(ids[:12], torch.arange(12), cache, 12)[0])
        i, accept = 12, 0
        while i < LONG:
            accept = accept % 5 + 1  # 1..5 rows kept per step; the rest of the 6-row block is junk
            keep = min(accept, LONG - i)
            block = torch.cat([ids[i:i + keep], junk[i:i + 6 - keep]])
            logits, _ = ours(block, torch.arange(i, i + 6), cache, i + 6)
            got.append(logits[:keep])
            i += keep
    assert (torch.cat(got) - ref).abs().max().item() < 1e-4


def test_ring_holds_any_engine_block():
    from flashdraft.engine.generator import MAX_BLOCK_SIZE

    assert RING_OVERHANG >= MAX_BLOCK_SIZE


def test_graph_style_calls_are_exact(dense):
    """As under CUDA graphs: kv_len rounded up past the last position, and each call run twice (warm-up, capture)."""
    _, hf, ours = dense
    ids = _ids(LONG, ours.config.vocab_size, seed=3)
    ref = reference_logits(hf, ids.tolist())
    cache, got = ours.new_cache(LONG + 64), []
    with torch.no_grad():
        got.append(ours(ids[:20], torch.arange(20), cache, 20)[0])
        for i in range(20, LONG, 4):
            j = min(i + 4, LONG)
            padded_len = -(-j // 32) * 32
            ours(ids[i:j], torch.arange(i, j), cache, padded_len)
            got.append(ours(ids[i:j], torch.arange(i, j), cache, padded_len)[0])
    assert (torch.cat(got) - ref).abs().max().item() < 1e-4


def test_taps_are_layer_outputs_after_layer_scalar(dense):
    _, hf, ours = dense
    ids = _ids(30, ours.config.vocab_size)
    with torch.no_grad():
        hs = hf(input_ids=ids[None], output_hidden_states=True).hidden_states
        _, taps = ours(ids, torch.arange(30), ours.new_cache(40), 30, tap_ids=[4, 1])
    ref = torch.cat([hs[5][0], hs[2][0]], dim=-1)
    assert (taps - ref).abs().max().item() < 1e-4
    scalars = [float(layer.layer_scalar) for layer in ours.model.layers]
    assert all(abs(s - 1.0) > 1e-3 for s in scalars)  # loaded from the checkpoint, not left at one


def test_embedding_scale_is_rounded_to_weight_dtype(dense):
    assert embedding_scale(5376, torch.bfloat16).item() == 73.5  # sqrt = 73.32
    assert embedding_scale(2816, torch.bfloat16).item() == 53.0  # sqrt = 53.07
    _, _, ours = dense
    ids = _ids(5, ours.config.vocab_size)
    expected = ours.model.embed_tokens.weight[ids] * math.sqrt(ours.config.hidden_size)
    assert torch.allclose(ours.embed(ids), expected)


def test_rmsnorm_has_no_unit_offset():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm as HFNorm

    x, w = torch.randn(3, 16), torch.randn(16)
    ours, ref = Gemma4RMSNorm(16), HFNorm(16)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(ours(x), x_hat * w, atol=1e-6)  # x_hat * w, not x_hat * (1 + w)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    assert torch.allclose(Gemma4RMSNorm(16, with_weight=False)(x), x_hat, atol=1e-6)  # the v norm


def test_full_layers_use_proportional_partial_rope():
    from flashdraft.models.gemma4.config import RopeSpec

    inv = rope_inverse_frequencies(RopeSpec("proportional", 1e6, partial_rotary_factor=0.25), 512)
    assert inv.shape == (256,)
    i = torch.arange(64, dtype=torch.float)
    assert torch.allclose(inv[:64], 1e6 ** (-2 * i / 512))  # exponent over the FULL head_dim
    assert (inv[64:] == 0).all()  # the other pairs pass through unrotated
    sliding = rope_inverse_frequencies(RopeSpec("default", 1e4), 256)
    assert torch.allclose(sliding, 1e4 ** (-torch.arange(0, 256, 2, dtype=torch.float) / 256))


def test_rope_per_layer_type_matches_transformers(dense):
    _, hf, ours = dense
    rotary = _hf_text(hf).rotary_emb
    for kind in ("sliding_attention", "full_attention"):
        assert torch.allclose(getattr(ours, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_inv_freq"))


def _additive_mask(T: int, sliding: bool) -> torch.Tensor:
    pos = torch.arange(T)
    ok = (pos[None, :] <= pos[:, None]) & ((pos[:, None] - pos[None, :] < WINDOW) if sliding else True)
    return torch.zeros(T, T).masked_fill(~ok, float("-inf"))[None, None]


def _run_attention(ours, layer: int, x: torch.Tensor, cache):
    T = x.shape[0]
    pos = torch.arange(T)
    kind = ours.config.layer_types[layer]
    return ours.model.layers[layer].self_attn(x, *ours._rope(pos)[kind], cache.k[layer], cache.v[layer], cache.ring,
                                              pos, T, ours._masks(pos, cache, T, False)[kind])


@pytest.mark.parametrize("layer", [0, 2], ids=["sliding", "full"])
def test_attention_matches_transformers(dense, layer):
    """q/k norms, weightless v norm, scale 1.0, per-type head shapes and RoPE, keys as values on full layers."""
    _, hf, ours = dense
    text = _hf_text(hf)
    hf_attn = text.layers[layer].self_attn
    x = torch.randn(20, ours.config.hidden_size)
    kind = ours.config.layer_types[layer]
    with torch.no_grad():
        cos, sin = text.rotary_emb(x[None], torch.arange(20)[None], kind)
        ref, _ = hf_attn(x[None], (cos, sin), _additive_mask(20, kind == "sliding_attention"), shared_kv_states={})
        got = _run_attention(ours, layer, x, ours.new_cache(32))
    assert (got - ref[0]).abs().max().item() < 1e-4


def test_full_layers_take_values_from_raw_keys(dense):
    folder, _, ours = dense
    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
    for i, kind in enumerate(ours.config.layer_types):
        has_v = f"model.language_model.layers.{i}.self_attn.v_proj.weight" in names
        assert has_v == (kind == "sliding_attention")
        assert (ours.model.layers[i].self_attn.v_proj is not None) == has_v
    layer = 2
    attn = ours.model.layers[layer].self_attn
    x = torch.randn(6, ours.config.hidden_size)
    cache = ours.new_cache(8)
    with torch.no_grad():
        _run_attention(ours, layer, x, cache)
        raw_k = attn.k_proj(x).view(6, attn.n_kv, attn.head_dim)
    # v_norm(k_proj(x)): without k_norm and without RoPE
    expected_v = raw_k * torch.rsqrt(raw_k.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (cache.v[layer][:, :6] - expected_v.transpose(0, 1)).abs().max().item() < 1e-5


def test_mlp_is_geglu_with_tanh_gelu(dense):
    _, hf, ours = dense
    ref = _hf_text(hf).layers[0].mlp
    mlp = ours.model.layers[0].mlp
    assert isinstance(mlp, GatedMLP) and mlp.gelu_tanh
    x = torch.randn(5, ours.config.hidden_size)
    with torch.no_grad():
        assert (mlp(x) - ref(x)).abs().max().item() < 1e-5
        exact = mlp.down_proj(F.gelu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert (mlp(x) - exact).abs().max().item() > 1e-6  # the tanh approximation, not exact gelu


def test_moe_router_matches_transformers(moe):
    _, hf, ours = moe
    x = torch.randn(9, ours.config.hidden_size)
    ref_router = _hf_text(hf).layers[1].router
    router = ours.model.layers[1].router
    assert not torch.allclose(router.per_expert_scale, torch.ones_like(router.per_expert_scale))
    with torch.no_grad():
        _, ref_w, ref_idx = ref_router(x)
        w, idx = router(x)
    assert torch.equal(idx, ref_idx)
    assert (w - ref_w).abs().max().item() < 1e-6


def test_moe_expert_paths_agree(moe):
    """The host-sync-free paths (gathered experts for decoding, all experts inside CUDA graphs) equal the loop."""
    _, _, ours = moe
    layer = ours.model.layers[1]
    x = torch.randn(9, ours.config.hidden_size)
    with torch.no_grad():
        w, idx = layer.router(x)
        looped = layer.experts(x, w, idx)  # 9 rows x 3 choices > 8 experts: the loop
        gathered = layer.experts._gathered(x, w, idx)
        every = layer.experts._all_experts(x, w, idx)
        single = torch.cat([layer.experts(x[r:r + 1], w[r:r + 1], idx[r:r + 1]) for r in range(9)])
    assert (looped - gathered).abs().max().item() < 1e-5
    assert (looped - every).abs().max().item() < 1e-5
    assert (looped - single).abs().max().item() < 1e-5


def test_moe_experts_and_shared_mlp_match_transformers(moe):
    """The experts (gate rows first in gate_up_proj) plus the always-on dense MLP and the three extra norms."""
    _, hf, ours = moe
    layer, ref_layer = ours.model.layers[1], _hf_text(hf).layers[1]
    x = torch.randn(9, ours.config.hidden_size)
    with torch.no_grad():
        w, idx = layer.router(x)
        assert (layer.experts(x, w, idx) - ref_layer.experts(x, idx, w)).abs().max().item() < 1e-5
    assert ours.config.num_experts == 8 and ours.config.top_k_experts == 3


def test_final_logit_softcapping(dense):
    _, _, ours = dense
    h = 50 * torch.randn(4, ours.config.hidden_size)
    cap = ours.config.final_logit_softcapping
    with torch.no_grad():
        raw = ours.lm_head(h)
        logits = ours.logits(h)
    assert torch.allclose(logits, cap * torch.tanh(raw / cap), atol=1e-5)
    assert logits.abs().max().item() <= cap
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied head


def test_config_spellings_agree(dense, moe):
    a, b = dense[2].config, moe[2].config
    assert a.layer_head_dims == b.layer_head_dims == [16, 16, 32, 16, 16, 32]
    assert a.layer_kv_heads == b.layer_kv_heads == [2, 2, 1, 2, 2, 1]
    assert a.rope == b.rope and a.sliding_window == b.sliding_window == WINDOW


def test_checkpoint_multimodal_towers_are_ignored(dense, tmp_path):
    folder, _, ours = dense
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file({"model.vision_tower.encoder.weight": torch.zeros(3, 3),
               "model.embed_vision.embedding_projection.weight": torch.zeros(2, 2)},
              str(tmp_path / "vision.safetensors"))
    again = load_target(tmp_path, 0, device="cpu", dtype=torch.float32)
    ids = _ids(12, ours.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(again(ids, torch.arange(12), again.new_cache(16), 12)[0],
                           ours(ids, torch.arange(12), ours.new_cache(16), 12)[0])


def test_unsupported_gemma4_variants_are_refused(dense):
    raw = json.loads((dense[0] / "config.json").read_text())
    ple = json.loads(json.dumps(raw))
    ple["text_config"]["hidden_size_per_layer_input"] = 256
    with pytest.raises(ConfigError, match="per-layer input embeddings"):
        Gemma4Config.from_dict(ple)
    shared = json.loads(json.dumps(raw))
    shared["text_config"]["num_kv_shared_layers"] = 2
    with pytest.raises(ConfigError, match="KV-shared"):
        Gemma4Config.from_dict(shared)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["layer_types"] = ["sliding_attention"] * 5
    with pytest.raises(ConfigError, match="layer_types has 5 entries"):
        Gemma4Config.from_dict(bad)


def test_compiled_layers_share_one_graph_per_layer_kind(dense):
    """A layer takes its own cache tensors (not the cache and its index), so torch.compile'd layers of one kind
    share their compiled graphs instead of compiling once per layer (a layer index read in forward is a guard:
    one compile per layer and token-count class, 12 here); the logits stay the eager ones."""
    folder, _, eager = dense
    compiled = load_target(folder, 0, device="cpu", dtype=torch.float32)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for layer in compiled.model.layers:
        layer.compile(dynamic=True)
    ids = _ids(24, eager.config.vocab_size, seed=4)
    caches = eager.new_cache(64), compiled.new_cache(64)
    with torch.no_grad():
        for lo, hi in ((0, 16), (16, 17), (17, 18), (18, 24)):
            want, got = (m(ids[lo:hi], torch.arange(lo, hi), c, hi)[0] for m, c in zip((eager, compiled), caches))
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    kinds = len(set(eager.config.layer_types))
    # per kind: one graph for one-token calls (Dynamo specializes size 1) and one for longer calls; plus the first
    # call's trace before the sizes were marked dynamic
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2 * kinds + 1 < 2 * len(compiled.model.layers)


def test_compiled_layers_fail_by_name_past_the_recompile_limit(dense, monkeypatch):
    """A compiled layer that needs more graphs than dynamo's recompile limit raises an error naming the limit
    (compile_layers sets that), where dynamo would otherwise run the new variant eagerly: eager rounds otherwise
    than compiled, so a verify pass could silently disagree with plain decoding."""
    from flashdraft.engine.model_prep import compile_layers

    folder, _, _ = dense
    compiled = load_target(folder, 0, device="cpu", dtype=torch.float32)
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", False)  # restored after the test
    compile_layers(compiled)
    assert torch._dynamo.config.fail_on_recompile_limit_hit
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    ids = _ids(24, compiled.config.vocab_size, seed=4)
    cache = compiled.new_cache(64)
    with torch.no_grad(), pytest.raises(Exception, match="recompile_limit"):
        for lo, hi in ((0, 16), (16, 17), (17, 18), (18, 24)):  # a second token-count class: a second graph
            compiled(ids[lo:hi], torch.arange(lo, hi), cache, hi)
    torch._dynamo.reset()


def causal_and_masked_prefill_agree(model, n: int, taps: list[int]) -> None:
    """An eager prefill pass (positions kv_len - T .. kv_len - 1) with causal=True attends from the lower right
    without a mask tensor: logits, taps and the cache as with the boolean mask, over a prefix already in the cache
    (n tokens in passes of 30, n - 30 and 3; the short one keeps its mask)."""
    ids = _ids(n, model.config.vocab_size, seed=5)
    runs = []
    for causal in (False, True):
        cache = model.new_cache(n + 8)
        with torch.no_grad():
            outs = [model(ids[a:b], torch.arange(a, b), cache, b, taps, causal=causal)
                    for a, b in ((0, 30), (30, n), (n - 3, n))]
        runs.append((outs, [t.clone() for t in (*cache.k, *cache.v)]))
    for a, b in zip(runs[0][0], runs[1][0]):
        torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a[1], b[1], rtol=1e-4, atol=1e-4)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_causal_prefill_passes_match_the_masked_ones(dense):
    """Gemma 4: the full layers attend from the lower right, the sliding layers keep their masks."""
    causal_and_masked_prefill_agree(dense[2], LONG, [0, 1])
