"""GGUF models: tiny checkpoints converted in-test (as llama.cpp's convert_hf_to_gguf.py lays them out) load
and match the safetensors originals: F32 within float noise, quantized exactly equal to the safetensors model
holding the dequantized weights, and drafter GGUFs (both layouts) decode losslessly."""
import json
import math
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file, save_file

from flashdraft.config import ConfigError, ModelConfig, SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.models import load_model, load_target
from flashdraft.loading.checkpoint import CheckpointError
from flashdraft.quant import QuantEmbedding, QuantLinear, UnsupportedQuantType, q4k_columns, q6k_lanes
from tiny_models import build_drafter, build_target

LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


# --- K-quant encoders (gguf-py only quantizes the 32-weight types); simple, not llama.cpp's search ---

def _f16_bytes(x):
    return x.astype(np.float16).view(np.uint8).reshape(len(x), 2)


def _pack_k_scales(sc, mn):
    """Inverse of Q4_K's 12-byte 6-bit packing (see flashdraft.quant.dequant._k_scales_mins)."""
    b = np.zeros((len(sc), 12), np.uint8)
    b[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    b[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    b[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return b


def _k_affine(x, levels):
    """Per 32-weight sub-block scale/min (6-bit, under fp16 super-scales) and codes in [0, levels]."""
    sub = x.reshape(len(x), 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = scale.max(-1, keepdims=True) / 63
    dmin = -lo.min(-1, keepdims=True) / 63
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, dmin, out=np.zeros_like(lo), where=dmin > 0)), 0, 63).astype(np.uint8)
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    step = (d16 * sc)[..., None]
    q = np.round(np.divide(sub + (dmin16 * mn)[..., None], step, out=np.zeros_like(sub), where=step > 0))
    return np.concatenate([_f16_bytes(d16), _f16_bytes(dmin16), _pack_k_scales(sc, mn)], 1), \
        np.clip(q, 0, levels).astype(np.uint8)


def _nibble_pack(q):
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(q), 128)


def quantize_q4_k(x):
    head, q = _k_affine(x, 15)
    return np.concatenate([head, _nibble_pack(q)], 1)


def quantize_q5_k(x):
    head, q = _k_affine(x, 31)
    qh = sum(((q[:, j] >> 4) << j) for j in range(8)).astype(np.uint8)
    return np.concatenate([head, qh, _nibble_pack(q & 0x0F)], 1)


def quantize_q6_k(x):
    sub = x.reshape(len(x), 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = scale.max(-1, keepdims=True) / 127
    sc = np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)).astype(np.int8)
    d16 = d.astype(np.float16).astype(np.float32)
    step = (d16 * sc)[..., None]
    q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(len(x), 256)
    lo, hi = (q & 0x0F).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d16)], 1)


K_ENCODERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, K] -> uint8 [rows, row_bytes] blocks of qtype (zero blocks for types we cannot encode)."""
    if qtype in K_ENCODERS:
        return K_ENCODERS[qtype](w.reshape(-1, 256)).reshape(w.shape[0], -1)
    try:
        return gguf.quants.quantize(w, QT[qtype])
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[QT[qtype]]
        return np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8)


# --- converters (convert_hf_to_gguf.py's layout) ---

def llama_permute(w, n_head):
    """convert_hf_to_gguf's LlamaModel.permute (q/k rows reordered for llama.cpp's interleaved RoPE)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_fields(cfg):
    """config.json with rope_theta / rope_scaling at top level, whichever layout transformers wrote."""
    ours = ModelConfig.from_dict(cfg)
    return {**cfg, "rope_theta": ours.rope_theta, "rope_scaling": ours.rope_scaling}


def llama3_rope_factors(cfg):
    rs, dim = cfg["rope_scaling"], cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, low, high = rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"]
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(rs["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def add_tokenizer(w, folder, pre="gpt-2", bos=None):
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tj["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_pad_token_id(vocab[tcfg["pad_token"]])
    w.add_add_bos_token(bos is not None)
    if bos is not None:
        w.add_bos_token_id(vocab[bos])
    w.add_chat_template(tcfg.get("chat_template") or (folder / "chat_template.jinja").read_text())
    return vocab


def add_layer_stack(w, cfg, n_layers):
    heads = cfg["num_attention_heads"]
    w.add_block_count(n_layers)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def add_tensors(w, tensors, qtype_of):
    for name, t in tensors.items():
        qtype = qtype_of(name) if t.ndim == 2 else "F32"
        if qtype == "F32":
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, quantize(t, qtype), raw_dtype=QT[qtype])


def write_gguf(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def target_to_gguf(folder, path, qtype_of=lambda name: "F32", tied=False, skip=(), **tokenizer):
    cfg = rope_fields(json.loads((folder / "config.json").read_text()))
    arch = cfg["model_type"]
    st = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), arch)
    add_layer_stack(w, cfg, cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    add_tokenizer(w, folder, **tokenizer)
    out = {"token_embd.weight": st["model.embed_tokens.weight"], "output_norm.weight": st["model.norm.weight"]}
    if not tied:
        out["output.weight"] = st["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        for ours, theirs in LAYER_NAMES.items():
            t = st.get(f"model.layers.{i}.{ours}.weight")
            if t is not None and arch == "llama" and theirs in ("attn_q", "attn_k"):
                t = llama_permute(t, cfg["num_attention_heads"] if theirs == "attn_q" else cfg["num_key_value_heads"])
            if t is not None:
                out[f"blk.{i}.{theirs}.weight"] = t
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(cfg)
    add_tensors(w, {k: v for k, v in out.items() if k not in skip}, qtype_of)
    write_gguf(w)
    return path


def drafter_to_gguf(folder, path, layout, qtype_of=lambda name: "F32"):
    cfg = rope_fields(json.loads((folder / "config.json").read_text()))
    st = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), "dflash-draft" if layout == "legacy" else "dflash")
    add_layer_stack(w, cfg, cfg["num_hidden_layers"])
    n_features = cfg["hidden_size"] * len(cfg["dflash_config"]["target_layer_ids"])
    add_dflash_keys_and_tensors(w, cfg, st, layout, qtype_of, n_target_features=n_features)
    write_gguf(w)
    return path


def add_dflash_keys_and_tensors(w, cfg, st, layout, qtype_of, n_target_features=None):
    """A drafter's DFlash keys and its tensors (st: our names -> arrays), in BeeLlama's legacy "dflash-draft" or
    the upstream "dflash" layout; the legacy n_target_features key only when given."""
    taps, mask = cfg["dflash_config"]["target_layer_ids"], cfg["dflash_config"]["mask_token_id"]
    if layout == "legacy":
        w.add_uint32("dflash-draft.dflash.block_size", cfg["block_size"])
        w.add_uint32("dflash-draft.dflash.mask_token_id", mask)
        w.add_array("dflash-draft.dflash.target_layer_ids", taps)
        if n_target_features is not None:
            w.add_uint32("dflash-draft.dflash.n_target_features", n_target_features)
        top = {"dflash_fc.weight": "fc.weight", "dflash_hidden_norm.weight": "hidden_norm.weight"}
        post_norm = "post_attention_norm"
    else:
        w.add_uint32("dflash.block_size", cfg["block_size"])
        w.add_array("dflash.target_layers", [i + 1 for i in taps])  # HF hidden_states indices
        w.add_mask_token_id(mask)
        top = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight"}
        post_norm = "ffn_norm"
    out = {g: st[ours] for g, ours in top.items()}
    out["output_norm.weight"] = st["norm.weight"]
    names = {**LAYER_NAMES, "post_attention_layernorm": post_norm}
    for i in range(cfg["num_hidden_layers"]):
        for ours, theirs in names.items():
            out[f"blk.{i}.{theirs}.weight"] = st[f"layers.{i}.{ours}.weight"]
    add_tensors(w, out, qtype_of)


def dequantized_folder(gguf_path, like_folder, dest):
    """A safetensors copy of like_folder whose weights are gguf-py's dequantization of the GGUF's tensors."""
    shutil.copytree(like_folder, dest)
    cfg = json.loads((like_folder / "config.json").read_text())
    reader = gguf.GGUFReader(str(gguf_path))
    theirs = {f"blk.{i}.{g}.weight": f"model.layers.{i}.{o}.weight"
              for i in range(cfg["num_hidden_layers"]) for o, g in LAYER_NAMES.items()}
    theirs.update({"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"})
    tensors = {}
    for t in reader.tensors:
        if t.name not in theirs:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if cfg["model_type"] == "llama" and ".attn_q." in t.name:
            w = llama_unpermute(w, cfg["num_attention_heads"])
        if cfg["model_type"] == "llama" and ".attn_k." in t.name:
            w = llama_unpermute(w, cfg["num_key_value_heads"])
        tensors[theirs[t.name]] = torch.from_numpy(np.array(w, dtype=np.float32))
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(len(ids)), model.new_cache(128), len(ids))[0]


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A tiny Qwen3 whose rows (hidden 256, FFN 512) hold whole 256-weight K-quant blocks."""
    return build_target(tmp_path_factory.mktemp("wide"), family="qwen3", layers=2, hidden=256, seed=5)


@pytest.mark.parametrize("family", ["qwen3_dir", "llama_dir"])
def test_f32_gguf_matches_safetensors(request, tmp_path, family, ids):
    folder = request.getfixturevalue(family)
    path = target_to_gguf(folder, tmp_path / "m.gguf")
    loaded = load_model(path, device="cpu", context_size=64)
    ref = load_target(folder, max_positions=128, device="cpu", dtype=torch.float32)
    assert (_logits(loaded.target, ids) - _logits(ref, ids)).abs().max().item() < 1e-4
    assert loaded.name == "m" and loaded.context_size == 64
    # The tokenizer built from GGUF metadata tokenizes and templates as the original one.
    from flashdraft.loading import Tokenizer
    tok = Tokenizer(folder)
    for text in ["def add(a, b):\n    return a + b", "Hello, world! ünïcode 123 <|im_end|>", "  two  spaces\n\n"]:
        assert loaded.tokenizer.encode(text) == tok.encode(text)
        assert loaded.tokenizer.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    msgs = [{"role": "user", "content": "hi"}]
    assert loaded.tokenizer.render_chat(msgs) == tok.render_chat(msgs)
    assert loaded.tokenizer.eos_token_id == tok.eos_token_id
    assert tok.eos_token_id in loaded.target.config.eos_token_ids


# (type of each tensor, bound on the logits' relative error vs the float model). Weight errors of these random
# tiny models are about 0.5% (8 bit) to 8% (4 bit) and grow about 5x through the layers; a misplaced row or
# block would give errors near 100%.
QUANT_CASES = {
    "Q8_0": (lambda n: "Q8_0", 0.05),
    "Q5_0": (lambda n: "Q5_0", 0.3),
    "Q4_0": (lambda n: "Q4_0", 0.5),
    "Q4_K": (lambda n: "Q4_K", 0.5),
    "Q5_K": (lambda n: "Q5_K", 0.3),
    "Q6_K": (lambda n: "Q6_K", 0.15),
    # llama-quantize's Q4_K_S recipe: Q5_K attn_v/ffn_down in early layers, Q6_K output.
    "Q4_K_S": (lambda n: "Q6_K" if n == "output.weight" else
               "Q5_K" if n.startswith("blk.0.") and ("attn_v" in n or "ffn_down" in n) else "Q4_K", 0.5),
}


@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quantized_gguf_is_the_dequantized_model(request, tmp_path, case, ids):
    qtype_of, tolerance = QUANT_CASES[case]
    k_quant = case.startswith(("Q4_K", "Q5_K", "Q6_K"))
    folder = request.getfixturevalue("wide_dir" if k_quant else "llama_dir")
    path = target_to_gguf(folder, tmp_path / "q.gguf", qtype_of)
    model = load_model(path, device="cpu", context_size=64).target
    # The weights stay in their blocks.
    q = model.model.layers[0].self_attn.q_proj
    kept = q6k_lanes.kept_qtype(qtype_of("blk.1.attn_q.weight"))  # Q6_K: in lane order
    if kept == "Q4_K" and q.out_features % q4k_columns.CHUNK_ROWS == 0:  # whole chunks: super-block-major
        kept = q4k_columns.QTYPE
    assert isinstance(q, QuantLinear) and q.blocks.dtype == torch.uint8 and q.qtype == kept
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    ours = _logits(model, ids)
    deq = load_target(dequantized_folder(path, folder, tmp_path / "deq"), 128, "cpu", torch.float32)
    assert torch.equal(ours, _logits(deq, ids))
    ref = _logits(load_target(folder, 128, "cpu", torch.float32), ids)
    assert 0 < ((ours - ref).norm() / ref.norm()).item() < tolerance


def test_fused_quantized_projections_compute_what_the_separate_ones_do(tmp_path, wide_dir, ids):
    """With the GPU's plan (fuse_projections), a Qwen3 GGUF's q/k/v and gate/up of one K-quant type become one
    QuantLinear each (the parts views of its blocks); Q4_K_S's Q5_K attn_v keeps layer 0's q/k/v apart. Logits as
    with separate projections."""
    from flashdraft.layers.plan import LayerPlan

    path = target_to_gguf(wide_dir, tmp_path / "q.gguf", QUANT_CASES["Q4_K_S"][0])
    apart = load_model(path, device="cpu", context_size=64).target
    fused = load_model(path, device="cpu", context_size=64, plan=LayerPlan(fuse_projections=True)).target
    apart.prepare()
    fused.prepare()
    first, second = (layer.self_attn for layer in fused.model.layers)
    assert first.qkv_proj is None and isinstance(second.qkv_proj, QuantLinear)
    assert second.qkv_proj.out_features == sum(p.out_features for p in (second.q_proj, second.k_proj,
                                                                        second.v_proj))
    assert second.k_proj.blocks.data_ptr() == second.qkv_proj.blocks.data_ptr() + second.q_proj.blocks.numel()
    for layer in fused.model.layers:
        assert isinstance(layer.mlp.gate_up_proj, QuantLinear)
        assert layer.fused_rows == 0  # no fused path: this plan's GEMM and attention are not Triton's
    assert all(layer.self_attn.qkv_proj is None for layer in apart.model.layers)
    ref, ours = _logits(apart, ids), _logits(fused, ids)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("qtype,folder", [("F32", "qwen3_dir"), ("Q8_0", "qwen3_dir"), ("Q6_K", "wide_dir")])
def test_tied_output_shares_the_embedding(request, tmp_path, qtype, folder, ids):
    """Q6_K too: the embedding keeps its rows in lane order and the head takes those rows, not a second copy."""
    model = load_model(target_to_gguf(request.getfixturevalue(folder), tmp_path / "t.gguf", lambda n: qtype,
                                      tied=True), device="cpu", context_size=64).target
    emb, head = model.model.embed_tokens, model.lm_head
    if qtype == "F32":
        assert head.weight is emb.weight
    else:
        assert head.blocks.data_ptr() == emb.blocks.data_ptr() and head.qtype == emb.qtype
    assert model.config.tie_word_embeddings and torch.equal(head.weight, emb.weight)
    assert torch.isfinite(_logits(model, ids)).all()


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_gguf_tokenizer_pre_tokenizers_and_bos(tmp_path, qwen3_dir, pre):
    path = target_to_gguf(qwen3_dir, tmp_path / "t.gguf", pre=pre, bos="<|endoftext|>")
    tok = load_model(path, device="cpu", context_size=64).tokenizer
    text = "def add(a, b):\n    return a + b  # 12345"
    ids = tok.encode(text)
    assert ids[0] == tok.hf.bos_token_id and tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_unknown_pre_tokenizer_is_named(tmp_path, qwen3_dir):
    with pytest.raises(ConfigError, match="unsupported pre-tokenizer 'mystery'"):
        load_model(target_to_gguf(qwen3_dir, tmp_path / "t.gguf", pre="mystery"), device="cpu")


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory, qwen3_dir):
    return target_to_gguf(qwen3_dir, tmp_path_factory.mktemp("tg") / "target.gguf", lambda n: "Q8_0")


@pytest.mark.parametrize("layout", ["legacy", "upstream"])
def test_drafter_gguf_layouts_load_as_safetensors(tmp_path, qwen3_dir, drafter_dir, layout):
    path = drafter_to_gguf(drafter_dir, tmp_path / "d.gguf", layout)
    loaded = load_model(qwen3_dir, path, device="cpu", context_size=64)
    ref = load_model(qwen3_dir, drafter_dir, device="cpu", context_size=64).drafter
    d = loaded.drafter
    assert (d.config.block_size, d.config.mask_token_id, d.config.target_layer_ids) == \
        (ref.config.block_size, ref.config.mask_token_id, ref.config.target_layer_ids)
    ours, theirs = d.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_gguf_target_and_drafter_decode_losslessly(tmp_path, target_gguf, qwen3_dir):
    """Q8_0 target, Q4_0 drafter (upstream layout; both layouts load identically, see above)."""
    drafter = drafter_to_gguf(build_drafter(tmp_path / "src", qwen3_dir, block_size=8, seed=7),
                              tmp_path / "d.gguf", "upstream", lambda n: "Q4_0")
    engine = Engine.load(target_gguf, drafter, device="cpu", context_size=128)
    assert isinstance(engine.decoder.drafter.fc, QuantLinear)
    prompt = engine.encode_prompt("def add(a, b):")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = engine.generate(prompt, params, draft=0)
    spec = engine.generate(prompt, params)
    assert spec.tokens == plain.tokens and len(plain.tokens) == 24
    assert spec.stats.draft_n > 0


def test_unsupported_quant_type_is_named(tmp_path, wide_dir):
    path = target_to_gguf(wide_dir, tmp_path / "q2.gguf", lambda n: "Q2_K" if n == "blk.1.ffn_up.weight" else "F32")
    with pytest.raises(UnsupportedQuantType, match="'blk.1.ffn_up.weight'.*Q2_K"):
        load_model(path, device="cpu", context_size=64)


def test_bad_gguf_inputs_get_clear_errors(tmp_path, qwen3_dir, drafter_dir):
    with pytest.raises(ConfigError, match="not found"):
        load_model(tmp_path / "absent.gguf", device="cpu")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        load_model(tmp_path / "junk.gguf", device="cpu")
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    write_gguf(w)
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'phi3'"):
        load_model(tmp_path / "phi.gguf", device="cpu")
    drafter = drafter_to_gguf(drafter_dir, tmp_path / "d.gguf", "legacy")
    with pytest.raises(ConfigError, match="drafter"):
        load_model(drafter, device="cpu")
    gguf_model = target_to_gguf(qwen3_dir, tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match="missing tensor 'blk.1.ffn_down.weight'"):
        load_model(target_to_gguf(qwen3_dir, tmp_path / "m2.gguf", skip=("blk.1.ffn_down.weight",)), device="cpu")
    with pytest.raises(ConfigError, match="not a DFlash drafter"):
        load_model(qwen3_dir, gguf_model, device="cpu", context_size=64)
