"""Gemma 4 GGUF files: tiny Gemma 4 checkpoints converted in-test in llama.cpp's `gemma4` layout (per-layer
sliding pattern and KV heads, key_length / key_length_swa, rope_freqs for the proportional RoPE, no attn_v under
k_eq_v, layer_output_scale, the MoE tensors, the "gemma4" tokenizer) load and match the safetensors originals:
F32 exactly, Q8_0 exactly equal to the model holding gguf-py's dequantized weights; Gemma DFlash drafter GGUFs
(both layouts) load as their safetensors originals and decode losslessly; unsupported variants are named."""
import json
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file, save_file
from test_gemma4_tiny import CHAT_TEMPLATE, SPECIALS, build_gemma4_target, build_gemma_drafter
from test_gguf import add_dflash_keys_and_tensors, add_layer_stack, quantize, write_gguf
from tiny_models import CORPUS

from flashdraft.bench.oracle import PlantedOracle
from flashdraft.config import ConfigError, SamplingParams
from flashdraft.models.gemma4.config import FULL, SLIDING
from flashdraft.engine.generator import Engine
from flashdraft.loading import Tokenizer
from flashdraft.models import load_drafter, load_model, load_target
from flashdraft.loading.checkpoint import CheckpointError
from flashdraft.models.gemma4.gguf import QuantGemma4Experts
from flashdraft.models.gemma4.model import RING_OVERHANG, Gemma4Experts, Gemma4LM, embedding_scale
from flashdraft.models.gemma4.drafter import Gemma4DFlashDrafter
from flashdraft.quant import QuantEmbedding, QuantLinear

WINDOW, DRAFT_WINDOW = 8, 6
PREFIX = "model.language_model."
# llama.cpp's Gemma4Model.set_vocab renders these as text (USER_DEFINED), the other added tokens are CONTROL.
VISIBLE = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}
BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")

# HF text-model tensor (under model.language_model.layers.N.) -> llama.cpp gemma4 tensor (under blk.N.)
GEMMA4_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "layer_scalar": "layer_output_scale.weight",
    "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight", "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}


# --- a Gemma-style tokenizer (transformers' GemmaTokenizer: U+2581 for spaces, byte fallback) ---

def build_spm_tokenizer(folder, vocab_size):
    """A GemmaTokenizer with Gemma's special ids, 256 <0xXX> byte tokens and BPE merges learned on CORPUS (never
    across a newline, as llama.cpp's gemma4 pre-tokenizer assumes); exactly vocab_size tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    specials = [SPECIALS.get(i, f"<unused{i}>") for i in range(max(SPECIALS) + 1)]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + byte_tokens, show_progress=False)
    trainer_tok.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused{i}>"] = i
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    tok = GemmaTokenizer(vocab=vocab, merges=merges)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return folder


def tokenizer_kv(tok_folder):
    tj = json.loads((tok_folder / "tokenizer.json").read_text())
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tj["added_tokens"] if t["special"]}
    types = [4 if t in VISIBLE else 3 if t in special else 6 if BYTE_TOKEN.fullmatch(t) else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": vocab["<bos>"],
        "tokenizer.ggml.eos_token_id": vocab["<eos>"], "tokenizer.ggml.unknown_token_id": vocab["<unk>"],
        "tokenizer.ggml.padding_token_id": vocab["<pad>"], "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": json.loads((tok_folder / "tokenizer_config.json").read_text()).get("chat_template")
        or (tok_folder / "chat_template.jinja").read_text(),
    }


def put_kv(w, key, value):
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


# --- the converter (llama.cpp's conversion/gemma.py Gemma4Model layout) ---

def gemma4_names(cfg):
    """HF tensor name -> GGUF tensor name for a tiny Gemma 4 text config."""
    names = {PREFIX + "embed_tokens.weight": "token_embd.weight", PREFIX + "norm.weight": "output_norm.weight"}
    for i in range(cfg["num_hidden_layers"]):
        names.update({f"{PREFIX}layers.{i}.{ours}": f"blk.{i}.{theirs}" for ours, theirs in GEMMA4_LAYER.items()})
    return names


def gemma4_to_gguf(folder, tok_folder, path, qtype_of=lambda name, shape: "F32", kv=None, skip=()):
    """Write folder's Gemma 4 text model as a llama.cpp gemma4 GGUF. kv overrides metadata (None drops a key)."""
    text = json.loads((folder / "config.json").read_text())["text_config"]
    rope = text["rope_parameters"]
    types, n = text["layer_types"], text["num_hidden_layers"]
    full_dim, swa_dim = text["global_head_dim"], text["head_dim"]
    meta = {
        "gemma4.context_length": text["max_position_embeddings"], "gemma4.embedding_length": text["hidden_size"],
        "gemma4.block_count": n, "gemma4.feed_forward_length": text["intermediate_size"],
        "gemma4.attention.head_count": text["num_attention_heads"],
        "gemma4.attention.head_count_kv": [text["num_key_value_heads"] if t == SLIDING
                                           else text["num_global_key_value_heads"] for t in types],
        "gemma4.attention.layer_norm_rms_epsilon": text["rms_norm_eps"],
        "gemma4.attention.key_length": full_dim, "gemma4.attention.value_length": full_dim,
        "gemma4.attention.key_length_swa": swa_dim, "gemma4.attention.value_length_swa": swa_dim,
        "gemma4.rope.freq_base": float(rope[FULL]["rope_theta"]),
        "gemma4.rope.freq_base_swa": float(rope[SLIDING]["rope_theta"]),
        "gemma4.rope.dimension_count": full_dim, "gemma4.rope.dimension_count_swa": swa_dim,
        "gemma4.final_logit_softcapping": float(text["final_logit_softcapping"]),
        "gemma4.attention.sliding_window": text["sliding_window"],
        "gemma4.attention.sliding_window_pattern": [t == SLIDING for t in types],
        "gemma4.attention.shared_kv_layers": 0, "gemma4.embedding_length_per_layer_input": 0,
        **tokenizer_kv(tok_folder),
    }
    if text.get("enable_moe_block"):
        meta.update({"gemma4.expert_count": text["num_experts"], "gemma4.expert_used_count": text["top_k_experts"],
                     "gemma4.expert_feed_forward_length": text["moe_intermediate_size"]})
    meta.update(kv or {})
    w = gguf.GGUFWriter(str(path), "gemma4")
    for key, value in meta.items():
        if value is not None:
            put_kv(w, key, value)
    st = load_file(str(folder / "model.safetensors"))
    names = gemma4_names(text)
    tensors = {names[k]: v.float().numpy() for k, v in st.items() if k in names}
    rotated = int(full_dim * rope[FULL]["partial_rotary_factor"] / 2)  # the converter's generate_extra_tensors
    tensors["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated), np.float32)
    for name, t in tensors.items():
        if name in skip:
            continue
        qtype = qtype_of(name, t.shape) if t.ndim >= 2 else "F32"
        if qtype == "F32":
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, quantize(t.reshape(-1, t.shape[-1]), qtype).reshape(*t.shape[:-1], -1),
                         raw_dtype=QT[qtype])
    write_gguf(w)
    return path


def q8_0(name, shape):
    """Q8_0 wherever a row holds whole 32-weight blocks, except the MoE router: llama-quantize keeps the others,
    and ffn_gate_inp, in float."""
    return "Q8_0" if shape[-1] % 32 == 0 and "ffn_gate_inp" not in name else "F32"


def gemma_drafter_to_gguf(folder, path, layout, qtype_of=lambda name: "F32"):
    """A z-lab Gemma drafter folder as BeeLlama's legacy dflash-draft GGUF or the upstream dflash one, with the
    sliding-window keys BeeLlama's converter writes (use_sliding_window: window + per-layer pattern)."""
    cfg = json.loads((folder / "config.json").read_text())
    st = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    arch = "dflash-draft" if layout == "legacy" else "dflash"
    w = gguf.GGUFWriter(str(path), arch)
    add_layer_stack(w, cfg, cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
    w.add_array(f"{arch}.attention.sliding_window_pattern", [t == SLIDING for t in cfg["layer_types"]])
    w.add_float32(f"{arch}.final_logit_softcapping", cfg["final_logit_softcapping"])
    add_dflash_keys_and_tensors(w, cfg, st, layout, qtype_of)
    write_gguf(w)
    return path


def dequantized_folder(gguf_path, folder, dest):
    """folder with every tensor replaced by gguf-py's dequantization of the GGUF's (the reference for Q8_0)."""
    shutil.copytree(folder, dest)
    text = json.loads((folder / "config.json").read_text())["text_config"]
    theirs = {g: ours for ours, g in gemma4_names(text).items()}
    st = load_file(str(folder / "model.safetensors"))
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        if t.name in theirs:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            st[theirs[t.name]] = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(st[theirs[t.name]].shape)
    save_file(st, str(dest / "model.safetensors"))
    return dest


# --- fixtures ---

@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return build_gemma4_target(tmp_path_factory.mktemp("g4_dense"), moe=False, window=WINDOW, seed=3)[0]


@pytest.fixture(scope="module")
def wide_dense_dir(tmp_path_factory):
    """Heads of 32 and 64 (the others' 16 and 32): wide enough for KV caches of block types."""
    return build_gemma4_target(tmp_path_factory.mktemp("g4_wide"), moe=False, window=WINDOW, seed=4, head_dim=32)[0]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_gemma4_target(tmp_path_factory.mktemp("g4_moe"), moe=True, window=WINDOW, seed=5)[0]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, dense_dir):
    vocab = json.loads((dense_dir / "config.json").read_text())["text_config"]["vocab_size"]
    return build_spm_tokenizer(tmp_path_factory.mktemp("g4_tok"), vocab)


def realigned(model):
    """Every float parameter copied to fresh memory. CPU matmuls may round differently for differently aligned
    weights (a safetensors file maps tensors at arbitrary offsets, a GGUF at 32 bytes), so exact comparisons
    need both models' weights allocated alike."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)
    return model


def _ids(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, block=7):
    """Prefill of 20, then blocks of 7 through the static caches and the sliding ring."""
    cache, parts = model.new_cache(len(ids) + 8), []
    with torch.no_grad():
        for i, j in [(0, 20)] + [(i, min(i + block, len(ids))) for i in range(20, len(ids), block)]:
            parts.append(model(ids[i:j], torch.arange(i, j), cache, j)[0])
    return torch.cat(parts)


LONG = WINDOW + RING_OVERHANG + 20


# --- tests ---

@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_f32_gemma4_gguf_equals_safetensors(request, tmp_path, tok_dir, layout):
    folder = request.getfixturevalue(f"{layout}_dir")
    loaded = load_model(gemma4_to_gguf(folder, tok_dir, tmp_path / "g.gguf"), device="cpu", context_size=128)
    ours, ref = loaded.target, load_target(folder, 0, device="cpu", dtype=torch.float32)
    assert isinstance(ours, Gemma4LM)
    for field in ("layer_types", "layer_kv_heads", "layer_head_dims", "sliding_window", "rope", "attention_k_eq_v",
                  "final_logit_softcapping", "tie_word_embeddings", "num_experts", "top_k_experts",
                  "moe_intermediate_size", "vocab_size", "bos_token_id"):
        assert getattr(ours.config, field) == getattr(ref.config, field), field
    assert ours.config.rope[FULL].rope_type == "proportional" and ours.config.attention_k_eq_v
    assert set(ours.config.eos_token_ids) == set(ref.config.eos_token_ids) == {1, 106, 50}
    assert all(layer.self_attn.v_proj is None for i, layer in enumerate(ours.model.layers)
               if ours.config.layer_types[i] == FULL)
    ids = _ids(LONG, ours.config.vocab_size)
    assert torch.equal(_logits(realigned(ours), ids), _logits(realigned(ref), ids))


@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_q8_0_gemma4_gguf_is_the_dequantized_model(request, tmp_path, tok_dir, layout):
    folder = request.getfixturevalue(f"{layout}_dir")
    path = gemma4_to_gguf(folder, tok_dir, tmp_path / "q.gguf", q8_0)
    model = load_model(path, device="cpu", context_size=128).target
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantLinear) and layer.self_attn.q_proj.qtype == "Q8_0"
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.blocks.data_ptr() == model.model.embed_tokens.blocks.data_ptr()  # tied, one copy
    if layout == "moe":  # gate_up rows (hidden 64) are quantized, down rows (24) are not: a mixed expert module
        assert isinstance(layer.experts, QuantGemma4Experts) and layer.experts.qtypes == \
            {"gate_up_proj": "Q8_0", "down_proj": "F32"}
    ids = _ids(LONG, model.config.vocab_size, seed=1)
    ours = _logits(model, ids)
    deq = load_target(dequantized_folder(path, folder, tmp_path / "deq"), 0, "cpu", torch.float32)
    assert torch.equal(ours, _logits(realigned(deq), ids))
    ref = _logits(load_target(folder, 0, "cpu", torch.float32), ids)
    # 8-bit weights err by about 0.5%; the random sandwich norms and layer scalars amplify it to a few percent
    # (0.07 seen for the dense model). A misplaced row or block would give errors near 100%. In the tiny MoE the
    # perturbation flips expert choices, which moves the logits by ~40%: there only the equality above says much.
    assert 0 < ((ours - ref).norm() / ref.norm()).item() < (0.15 if layout == "dense" else 0.6)


def test_embed_scale_never_dequantizes_the_embedding(tmp_path, dense_dir, tok_dir, monkeypatch):
    model = load_model(gemma4_to_gguf(dense_dir, tok_dir, tmp_path / "q.gguf", q8_0), device="cpu",
                       context_size=64).target
    emb = model.model.embed_tokens
    rows = emb(torch.tensor([5, 7]))

    def whole_table(self):
        raise AssertionError("the whole embedding was dequantized")

    monkeypatch.setattr(QuantEmbedding, "weight", property(whole_table))
    scale = model.embed_scale
    assert scale is model.embed_scale  # made once
    assert scale.dtype == torch.float32 and scale.item() == embedding_scale(64, torch.float32).item()
    assert torch.equal(model.embed(torch.tensor([5, 7])), rows * scale)
    emb.dtype = torch.bfloat16  # a new compute dtype gets its own (rounded) scale
    assert model.embed_scale.dtype == torch.bfloat16 and model.embed_scale.item() == 8.0


def test_quantized_experts_equal_dequantized_experts():
    """All three expert paths (gathered for decoding, the expert loop, every expert for graph capture)."""
    e, h, m = 8, 64, 32
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(e, 2 * m, h, generator=g), torch.randn(e, h, m, generator=g)
    blocks = [torch.from_numpy(quantize(t.reshape(-1, t.shape[-1]).numpy(), "Q8_0")).reshape(e, t.shape[1], -1)
              for t in (gate_up, down)]
    quant = QuantGemma4Experts((blocks[0], "Q8_0"), (blocks[1], "Q8_0"), h, m, torch.float32)
    dense = Gemma4Experts.__new__(Gemma4Experts)
    torch.nn.Module.__init__(dense)
    for name, b, shape in (("gate_up_proj", blocks[0], gate_up.shape), ("down_proj", blocks[1], down.shape)):
        deq = gguf.quants.dequantize(b.reshape(-1, b.shape[-1]).numpy(), QT.Q8_0).reshape(shape)
        setattr(dense, name, torch.nn.Parameter(torch.from_numpy(np.array(deq, dtype=np.float32))))
    x = torch.randn(5, h, generator=g)
    experts = torch.stack([torch.randperm(e, generator=g)[:3] for _ in range(5)])
    weights = torch.rand(5, 3, generator=g)
    for path in ("forward", "_gathered", "_all_experts"):
        assert torch.equal(getattr(quant, path)(x, weights, experts), getattr(dense, path)(x, weights, experts)), path


def test_experts_give_a_token_the_same_bits_alone_and_in_a_verify_block():
    """Decoding (one token) and a verify block (16) must give a token the same expert products, or greedy DFlash
    could part from plain decoding: the float and the quantized (dequantized-path) modules, a token alone against
    the same token among 16, whose choices cover most experts (the expert loop took such blocks before)."""
    e, h, m, top = 8, 64, 32, 3
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(e, 2 * m, h, generator=g), torch.randn(e, h, m, generator=g)
    blocks = [torch.from_numpy(quantize(t.reshape(-1, t.shape[-1]).numpy(), "Q8_0")).reshape(e, t.shape[1], -1)
              for t in (gate_up, down)]
    dense = Gemma4Experts.__new__(Gemma4Experts)
    torch.nn.Module.__init__(dense)
    dense.gate_up_proj, dense.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
    quant = QuantGemma4Experts((blocks[0], "Q8_0"), (blocks[1], "Q8_0"), h, m, torch.float32)
    x = torch.randn(16, h, generator=g)
    experts = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(16)])
    weights = torch.rand(16, top, generator=g)
    for module in (dense, quant):
        block = module(x, weights, experts)
        for t in range(16):
            assert torch.equal(module(x[t:t + 1], weights[t:t + 1], experts[t:t + 1]), block[t:t + 1]), (module, t)


def test_gemma4_gguf_tokenizer_matches_gemma_tokenizer(tmp_path, dense_dir, tok_dir):
    loaded = load_model(gemma4_to_gguf(dense_dir, tok_dir, tmp_path / "g.gguf"), device="cpu", context_size=64)
    ours, ref = loaded.tokenizer, Tokenizer(tok_dir)
    texts = ["def add(a, b):\n    return a + b", "Hello, world!  two  spaces\n\n\nend ", "ünïcode ✓ 123",
             "<|turn>user\nhi<turn|>\n<|turn>model\n", "import os\n\nif __name__ == '__main__':"]
    for text in texts:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.encode(text) == [2] + ids  # tokenizer.ggml.add_bos_token, as llama.cpp's converter writes
    plain = ref.encode(texts[0] + texts[2], add_special_tokens=False)
    assert ours.decode(plain) == ref.decode(plain) == texts[0] + texts[2]
    assert any(BYTE_TOKEN.fullmatch(t) for t in ref.hf.convert_ids_to_tokens(ref.encode(texts[2])))  # byte fallback
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.render_chat(msgs) == ref.render_chat(msgs) and ours.encode_chat(msgs) == ref.encode_chat(msgs)
    assert ours.encode_chat(msgs).count(2) == 1  # one <bos>, written by the template
    assert ours.eos_token_id == ref.eos_token_id == 1


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, dense_dir):
    return build_gemma_drafter(tmp_path_factory.mktemp("g4_drafter"), dense_dir, window=DRAFT_WINDOW, block_size=6)


@pytest.mark.parametrize("layout", ["legacy", "upstream"])
def test_gemma_drafter_gguf_loads_as_safetensors(tmp_path, dense_dir, tok_dir, drafter_dir, layout):
    target = load_model(gemma4_to_gguf(dense_dir, tok_dir, tmp_path / "t.gguf"), device="cpu",
                        context_size=64).target
    d = load_model(tmp_path / "t.gguf", gemma_drafter_to_gguf(drafter_dir, tmp_path / "d.gguf", layout),
                   device="cpu", context_size=64).drafter
    ref = load_drafter(drafter_dir, target, 128)
    assert isinstance(d, Gemma4DFlashDrafter)
    for field in ("block_size", "mask_token_id", "target_layer_ids", "layer_types", "layer_causal", "sliding_window",
                  "final_logit_softcapping", "block_embedding_scale"):
        assert getattr(d.config, field) == getattr(ref.config, field), field
    assert d.config.layer_causal == [True, True, False] and d.block_factor == ref.block_factor == 1.0
    ours, theirs = d.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("layout,fuse,attention,types,v_apart",
                         [("dense", False, "sdpa", None, False), ("moe", False, "sdpa", None, False),
                          ("dense", True, "sdpa", None, False), ("dense", True, "triton", None, False),
                          ("wide_dense", True, "triton", ("q5_0", "q4_1"), False),
                          ("dense", True, "triton", None, True)],
                         ids=["dense-False-sdpa", "moe-False-sdpa", "dense-True-sdpa", "dense-True-triton",
                              "wide-dense-True-triton-q5_0-q4_1", "dense-True-triton-v-apart"])
def test_gemma4_gguf_target_and_drafter_decode_losslessly(request, tmp_path, tok_dir, layout, fuse, attention,
                                                          types, v_apart, record_values_apart):
    """Q8_0 target and drafter; guesses partly replaced by the target's own tokens so that every acceptance
    length, and so every rollback depth, occurs, past both windows and the target's ring. fuse: both built with
    the GPU's fused projections (one q/k/v and one gate/up product per layer); attention "triton": also the GPU's
    few-row attention (decode_attention), the target's norms, RoPE and cache writes then one qkv_prep a layer.
    types: the target's KV cache types (the walkthrough's -ctk q5_0 -ctv q4_1: qkv_prep quantizes the rows).
    v_apart: layer 0's attn_v of another type (Q4_0), so its q and k are one product and qkv_prep reads its
    values from their own (as a Q4_K_S file's first layers with their Q5_K attn_v)."""
    from flashdraft.engine.generator import MAX_BLOCK_SIZE
    from flashdraft.layers.plan import LayerPlan
    from flashdraft.models.gemma4 import model as gemma_model

    values_apart = record_values_apart(gemma_model)

    def target_type(name, shape):
        return "Q4_0" if v_apart and name == "blk.0.attn_v.weight" else q8_0(name, shape)

    folder = request.getfixturevalue(f"{layout}_dir")
    drafter = build_gemma_drafter(tmp_path / "src", folder, window=DRAFT_WINDOW, block_size=6, seed=9)
    files = (gemma4_to_gguf(folder, tok_dir, tmp_path / "t.gguf", target_type),
             gemma_drafter_to_gguf(drafter, tmp_path / "d.gguf", "legacy", lambda n: "Q8_0"))
    if attention == "triton":
        pytest.importorskip("triton")
        from triton_interpreter import interpret_layer_kernels
        interpret_layer_kernels()
    # the GPU's paths on the GPU where there is one (Triton compiles there, and takes no CPU tensors)
    device = "cuda" if fuse and torch.cuda.is_available() else "cpu"
    if fuse:
        loaded = load_model(*files, device=device, context_size=256, overhang=MAX_BLOCK_SIZE,
                            plan=LayerPlan(attention=attention, fuse_projections=True))
        engine = Engine(loaded.target, loaded.tokenizer, loaded.drafter, loaded.context_size,
                        cache_type_k=types and types[0], cache_type_v=types and types[1])
        assert types is None or engine.new_sequence().target_cache.k[0].dtype == torch.uint8
        assert all(layer.mlp.gate_up_proj is not None for layer in engine.decoder.target.model.layers)
        assert all((layer.self_attn.prep_rows > 0) == (attention == "triton")
                   for layer in engine.decoder.target.model.layers)
        first = engine.decoder.target.model.layers[0].self_attn
        assert (first.qkv_proj is None and isinstance(first.qk_proj, QuantLinear)) == v_apart
    else:
        engine = Engine.load(*files, device="cpu", context_size=256)
    assert isinstance(engine.decoder.drafter.fc, QuantLinear)
    prompt = engine.encode_prompt(prompt="The quick brown fox jumps over the lazy dog.\n" * 4)
    assert len(prompt) > WINDOW
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = engine.generate(prompt, params, draft=0)
    assert len(prompt) + len(plain.tokens) > WINDOW + RING_OVERHANG
    # every acceptance length in turn (0 to all); on the device, so that a CUDA graph can capture it
    oracle = PlantedOracle(prompt + plain.tokens, lambda s: s % (engine.max_draft + 1),
                           engine.decoder.target.config.vocab_size, device)
    drafted = engine.generate(prompt, params, draft=engine.max_draft, sequence=engine.new_sequence(oracle=oracle))
    assert drafted.tokens == plain.tokens and drafted.stats.draft_n_accepted > 0
    assert any(values_apart) == v_apart  # only layer 0 of the v_apart file hands qkv_prep a v of its own


UNSUPPORTED = {
    "per-layer input embeddings": {"gemma4.embedding_length_per_layer_input": 8},
    "KV-shared layers": {"gemma4.attention.shared_kv_layers": 2},
    "double-wide MLP": {"gemma4.feed_forward_length": [96, 96, 96, 96, 192, 192]},
    "unsupported tokenizer model 'bert'": {"tokenizer.ggml.model": "bert"},
    "missing metadata gemma4.attention.sliding_window_pattern": {"gemma4.attention.sliding_window_pattern": None},
    "partial RoPE on sliding layers": {"gemma4.rope.dimension_count_swa": 8},
}


@pytest.mark.parametrize("what", list(UNSUPPORTED))
def test_unsupported_gemma4_variants_are_named(tmp_path, dense_dir, tok_dir, what):
    path = gemma4_to_gguf(dense_dir, tok_dir, tmp_path / "u.gguf", kv=UNSUPPORTED[what])
    with pytest.raises(ConfigError, match=re.escape(what)):
        load_model(path, device="cpu", context_size=64)


def test_broken_gemma4_files_are_named(tmp_path, dense_dir, tok_dir):
    text = json.loads((dense_dir / "config.json").read_text())["text_config"]
    full = [i for i, t in enumerate(text["layer_types"]) if t == FULL]
    path = gemma4_to_gguf(dense_dir, tok_dir, tmp_path / "a.gguf", skip=(f"blk.{full[0]}.layer_output_scale.weight",))
    model = load_model(path, device="cpu", context_size=64).target  # optional in llama.cpp: then 1
    assert model.model.layers[full[0]].layer_scalar.item() == 1.0
    path = gemma4_to_gguf(dense_dir, tok_dir, tmp_path / "b.gguf", skip=("blk.0.attn_v.weight",))
    with pytest.raises(CheckpointError, match="missing tensor 'blk.0.attn_v.weight'"):
        load_model(path, device="cpu", context_size=64)
    path = gemma4_to_gguf(dense_dir, tok_dir, tmp_path / "c.gguf", skip=("blk.1.post_ffw_norm.weight",))
    with pytest.raises(CheckpointError, match="missing tensor 'blk.1.post_ffw_norm.weight'"):
        load_model(path, device="cpu", context_size=64)


def _storage_bytes(model) -> int:
    """Bytes of the distinct memory that the model's parameters and buffers occupy (views counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def test_fused_projections_compute_what_the_separate_ones_do(tmp_path, dense_dir, tok_dir):
    """With the GPU's plan (fuse_projections), prepare() turns each layer's q/k/v and gate/up into one projection
    where they are alike (here: Q8_0 everywhere but layer 0's v, which stays apart, its q and k one); the parts
    become views of the fused weights (no memory added) and the logits are those of the separate projections. The
    float checkpoint fuses as plain Linear layers."""
    from flashdraft.layers.plan import LayerPlan
    from flashdraft.layers.skinny_gemm import Linear

    def mixed(name, shape):
        return "Q4_0" if name == "blk.0.attn_v.weight" else q8_0(name, shape)

    path = gemma4_to_gguf(dense_dir, tok_dir, tmp_path / "m.gguf", mixed)
    fused_plan = LayerPlan(fuse_projections=True)
    for load in (lambda plan: load_model(path, device="cpu", context_size=128, plan=plan).target,
                 lambda plan: load_target(dense_dir, 0, "cpu", torch.float32, plan)):
        apart, fused = load(LayerPlan()), load(fused_plan)
        apart.prepare()
        size = _storage_bytes(fused)
        fused.prepare()
        fused.prepare()  # once: a second engine over the same target prepares it again
        assert _storage_bytes(fused) == size
        kind = QuantLinear if isinstance(fused.model.layers[0].mlp.gate_proj, QuantLinear) else Linear
        for i, layer in enumerate(fused.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            assert apart.model.layers[i].self_attn.qkv_proj is None and apart.model.layers[i].mlp.gate_up_proj is None
            assert type(mlp.gate_up_proj) is kind
            parts = [p for p in (attn.q_proj, attn.k_proj, attn.v_proj) if p is not None]
            if kind is QuantLinear and i == 0:  # Q8_0 q and k as one, the Q4_0 v apart
                assert attn.qkv_proj is None and type(attn.qk_proj) is QuantLinear
                assert attn.q_proj.blocks.data_ptr() == attn.qk_proj.blocks.data_ptr()  # a view
                continue
            assert type(attn.qkv_proj) is kind
            assert attn.qkv_proj.out_features == sum(p.out_features for p in parts)
            store = (lambda m: m.blocks) if kind is QuantLinear else (lambda m: m.weight)
            assert store(parts[0]).data_ptr() == store(attn.qkv_proj).data_ptr()
            assert store(mlp.up_proj).data_ptr() > store(mlp.gate_up_proj).data_ptr()
        ids = _ids(LONG, fused.config.vocab_size, seed=2)
        ref, ours = _logits(apart, ids), _logits(fused, ids)
        assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
