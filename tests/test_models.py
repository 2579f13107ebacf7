"""Our own Qwen3 / Llama / drafter code against transformers' implementations and z-lab's layout."""
import json
import shutil

import pytest
import torch
import transformers

from flashdraft.config import ConfigError
from flashdraft.engine.generator import Engine
from flashdraft.models import load_target
from flashdraft.loading.checkpoint import CheckpointError
from tiny_models import build_target


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("fixture", ["qwen3_dir", "llama_dir", "qwen3_sharded_dir"])
def test_logits_match_transformers(request, fixture):
    path = request.getfixturevalue(fixture)
    hf = _hf(path)
    ours = load_target(path, max_positions=128, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (70,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        cache = ours.new_cache(128)
        full, _ = ours(ids, torch.arange(70), cache, 70)
        assert (full - ref).abs().max().item() < 1e-4
        # Incremental decoding through the static cache gives the same logits.
        cache = ours.new_cache(128)
        parts = [ours(ids[:30], torch.arange(30), cache, 30)[0]]
        for i in range(30, 70, 5):
            parts.append(ours(ids[i:i + 5], torch.arange(i, i + 5), cache, i + 5)[0])
        assert (torch.cat(parts) - ref).abs().max().item() < 1e-4


def test_taps_are_decoder_layer_outputs(qwen3_dir):
    """Tap id i is HF hidden_states[i + 1] (the output of decoder layer i), concatenated in list order."""
    hf = _hf(qwen3_dir)
    ours = load_target(qwen3_dir, max_positions=64, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (20,))
    with torch.no_grad():
        hs = hf(ids[None], output_hidden_states=True).hidden_states
        _, taps = ours(ids, torch.arange(20), ours.new_cache(64), 20, tap_ids=[2, 0])
    ref = torch.cat([hs[3][0], hs[1][0]], dim=-1)
    assert taps.shape == ref.shape
    assert (taps - ref).abs().max().item() < 1e-4


def test_rollback_is_free_and_exact(qwen3_dir):
    """Running rows past a point and then re-running from that point gives the same logits as never having run them."""
    ours = load_target(qwen3_dir, max_positions=64, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, ours.config.vocab_size, (30,))
    other = torch.randint(0, ours.config.vocab_size, (10,))
    with torch.no_grad():
        cache = ours.new_cache(64)
        ref, _ = ours(ids, torch.arange(30), cache, 30)
        cache = ours.new_cache(64)
        ours(ids[:20], torch.arange(20), cache, 20)
        ours(other, torch.arange(20, 30), cache, 30)  # a rejected block, then "rolled back" to 20
        tail, _ = ours(ids[20:], torch.arange(20, 30), cache, 30)
    assert (tail - ref[20:]).abs().max().item() < 1e-5


def test_drafter_loads_zlab_layout(qwen3_dir, drafter_dir):
    cfg = json.loads((drafter_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "dflash_config" in cfg
    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=64)
    assert engine.max_draft == cfg["block_size"] - 1
    names = set(dict(engine.decoder.drafter.named_parameters()))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.1.mlp.down_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_block_size_inside_dflash_config(tmp_path, qwen3_dir, drafter_dir):
    """Qwen3.5-style drafters put block_size inside dflash_config."""
    d = tmp_path / "d"
    shutil.copytree(drafter_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    (d / "config.json").write_text(json.dumps(cfg))
    assert Engine.load(qwen3_dir, d, device="cpu", context_size=64).max_draft == cfg["dflash_config"]["block_size"] - 1


def _edit_drafter(tmp_path, drafter_dir, edit_config=None, edit_tensors=None):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "bad_drafter"
    shutil.copytree(drafter_dir, d)
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        t = load_file(str(d / "model.safetensors"))
        edit_tensors(t)
        save_file(t, str(d / "model.safetensors"))
    return d


def test_drafter_missing_tensor_named(tmp_path, qwen3_dir, drafter_dir):
    d = _edit_drafter(tmp_path, drafter_dir, edit_tensors=lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.self_attn\.k_norm\.weight'"):
        Engine.load(qwen3_dir, d, device="cpu", context_size=64)


def test_drafter_wrong_shape_named(tmp_path, qwen3_dir, drafter_dir):
    def widen(t):
        t["fc.weight"] = torch.zeros(t["fc.weight"].shape[0], t["fc.weight"].shape[1] + 1)
    d = _edit_drafter(tmp_path, drafter_dir, edit_tensors=widen)
    with pytest.raises(CheckpointError, match=r"'fc\.weight' has shape"):
        Engine.load(qwen3_dir, d, device="cpu", context_size=64)


def test_drafter_hidden_size_mismatch_named(tmp_path, qwen3_dir, drafter_dir):
    d = _edit_drafter(tmp_path, drafter_dir, edit_config=lambda c: c.update(hidden_size=96))
    with pytest.raises(ConfigError, match="hidden_size 96 != target hidden_size 64"):
        Engine.load(qwen3_dir, d, device="cpu", context_size=64)


def test_not_a_drafter(tmp_path, qwen3_dir):
    with pytest.raises(ConfigError, match="not a DFlash drafter"):
        Engine.load(qwen3_dir, qwen3_dir, device="cpu", context_size=64)


def test_target_missing_tensor_named(tmp_path, qwen3_dir):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "t"
    shutil.copytree(qwen3_dir, d)
    t = load_file(str(d / "model.safetensors"))
    t.pop("model.layers.2.mlp.up_proj.weight")
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        Engine.load(d, device="cpu", context_size=64)


def test_unsupported_architecture(tmp_path, qwen3_dir):
    d = tmp_path / "m"
    shutil.copytree(qwen3_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"unsupported architecture \['MambaForCausalLM'\]"):
        Engine.load(d, device="cpu")


def test_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="model folder not found"):
        Engine.load(tmp_path / "nope", device="cpu")


def test_fused_projections_same_logits(qwen3_dir, drafter_dir):
    """The CUDA default fuses q/k/v and gate/up into single GEMMs (LayerPlan.fuse_projections, laid out by
    prepare); the results must not change, and no memory is added."""
    from flashdraft.config import SamplingParams
    from flashdraft.layers import LayerPlan
    from flashdraft.models import load_model
    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=64)
    target = engine.decoder.target
    assert target.model.layers[0].self_attn.qkv_proj is None  # the CPU default: no fused projections
    loaded = load_model(qwen3_dir, drafter_dir, device="cpu", context_size=64, plan=LayerPlan(fuse_projections=True))
    fused = Engine(loaded.target, loaded.tokenizer, loaded.drafter, loaded.context_size)
    assert loaded.target.model.layers[0].self_attn.qkv_proj is not None
    ids = torch.randint(0, target.config.vocab_size, (20,))
    with torch.no_grad():
        ref, ref_taps = target(ids, torch.arange(20), target.new_cache(64), 20, tap_ids=[1])
        out, taps = loaded.target(ids, torch.arange(20), target.new_cache(64), 20, tap_ids=[1])
    assert (out - ref).abs().max().item() < 1e-5 and (taps - ref_taps).abs().max().item() < 1e-5
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    assert fused.generate(ids.tolist(), params).tokens == engine.generate(ids.tolist(), params, draft=0).tokens
    assert sum(p.numel() for p in target.parameters()) == sum(p.numel() for p in loaded.target.parameters())


def test_causal_prefill_passes_match_the_masked_ones(tmp_path):
    """Qwen3 (grouped query heads): an eager prefill pass's lower-right causal attention, as with its mask."""
    from test_gemma4_target import causal_and_masked_prefill_agree

    model = load_target(build_target(tmp_path / "q", family="qwen3", layers=2), 256, "cpu", torch.float32)
    causal_and_masked_prefill_agree(model, 120, [0, 1])


def test_gated_mlp_takes_its_activation_at_construction():
    """One gated MLP for both families: SiLU (SwiGLU) by default, GELU's tanh approximation (GeGLU) when asked,
    anything else refused by name."""
    from flashdraft.models.llama.model import GatedMLP
    torch.manual_seed(0)
    swiglu, geglu = GatedMLP(8, 16), GatedMLP(8, 16, activation="gelu_tanh")
    geglu.load_state_dict(swiglu.state_dict())
    x = torch.randn(3, 8)
    with torch.no_grad():
        gate, up = swiglu.gate_proj(x), swiglu.up_proj(x)
        assert torch.equal(swiglu(x), swiglu.down_proj(torch.nn.functional.silu(gate) * up))
        assert torch.equal(geglu(x), swiglu.down_proj(torch.nn.functional.gelu(gate, approximate="tanh") * up))
    with pytest.raises(ValueError, match="activation 'relu'"):
        GatedMLP(8, 16, activation="relu")


def test_the_registry_maps_architecture_names_to_families():
    """HF model_types and GGUF architectures pick their family's loaders; any other name goes to the Llama
    family's, which refuse it by name (test_unsupported_architecture)."""
    from flashdraft.models import registry

    assert registry.family("qwen3") is registry.family("llama") is registry.LLAMA
    assert registry.family("gemma4") is registry.family("gemma4_text") is registry.GEMMA4
    assert registry.family("mamba") is registry.LLAMA and registry.family(None) is registry.LLAMA
