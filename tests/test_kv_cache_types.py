"""KV cache types (-ctk / -ctv): llama.cpp's blocks (gguf-py's bytes, laid out by field), exact dequantization,
memory per token, the caches and attention paths that store and read them, and lossless DFlash with each type."""
from pathlib import Path

import numpy as np
import pytest
import torch

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.models.kv_cache import KVCache
from flashdraft.quant import kv_formats as kf
from tiny_models import build_drafter, build_target


@pytest.fixture(scope="module")
def gguf_py():
    """gguf-py's numpy quantizers (llama.cpp's reference rules) and its type enum."""
    quants = pytest.importorskip("gguf.quants")
    return quants.quantize, quants.GGMLQuantizationType

BLOCK_TYPES = ["q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]
# ggml-common.h: bytes per 32 values (fp16 scale(s), high bits, packed quants), written out here independently
BLOCK_BYTES = {"q8_0": 2 + 32, "q5_1": 2 + 2 + 4 + 16, "q5_0": 2 + 4 + 16, "q4_1": 2 + 2 + 16, "q4_0": 2 + 16}


def _rows(seed: int, shape=(3, 7, 128)) -> torch.Tensor:
    """Random rows of varied scale, with the blocks the rules single out: all zeros, constant, a tie for the
    largest magnitude between a negative and a positive value, one outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 5
    flat = x.view(-1, shape[-1])
    flat[0, :32] = 0.0
    flat[1, :32] = 0.75
    flat[2, :32], flat[2, 3], flat[2, 9] = 0.1, -2.0, 2.0
    flat[3, 20] = 300.0
    return x


def _by_field(blocks: np.ndarray, name: str) -> np.ndarray:
    """ggml-common.h blocks [rows, n * block_bytes] -> the cache's layout by field (kv_formats' docstring): all
    quants (int8, or two values a byte: value 2i low, 2i + 1 high), the 5-bit types' high-bit fields, the scales
    d, the minimums m."""
    rows = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES[name])
    if name == "q8_0":
        return np.concatenate([rows[:, :, 2:].reshape(len(rows), -1), rows[:, :, :2].reshape(len(rows), -1)], 1)
    affine, five = name.endswith("_1"), name.startswith("q5")
    high = 2 + 2 * affine
    qs = rows[:, :, high + 4 * five:]
    values = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(len(rows), -1)  # [rows, head_dim] of 0..15
    fields = [(values[:, 0::2] | (values[:, 1::2] << 4)).astype(np.uint8)]
    if five:
        fields.append(rows[:, :, high:high + 4].reshape(len(rows), -1))
    fields.append(rows[:, :, 0:2].reshape(len(rows), -1))
    if affine:
        fields.append(rows[:, :, 2:4].reshape(len(rows), -1))
    return np.concatenate(fields, 1)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_blocks_are_gguf_py_bytes(name, gguf_py):
    """Every row holds gguf-py's blocks, their fields regrouped (and nibbles paired) as the cache lays them out."""
    quantize, GGMLQuantizationType = gguf_py
    x = _rows(1)
    ours = kf.quantize(x, kf.kv_format(name))
    ref = quantize(x.reshape(-1, 128).numpy(), getattr(GGMLQuantizationType, name.upper()))
    assert ours.dtype == torch.uint8 and ours.shape == (3, 7, 128 // 32 * BLOCK_BYTES[name])
    assert np.array_equal(ours.reshape(-1, ours.shape[-1]).numpy(), _by_field(ref, name))


def test_float_types_are_rounded_casts(gguf_py):
    quantize, GGMLQuantizationType = gguf_py
    x = _rows(2)
    assert np.array_equal(kf.quantize(x, kf.kv_format("bf16")).view(torch.int16).numpy(),
                          quantize(x.numpy(), GGMLQuantizationType.BF16).view(np.int16))
    assert np.array_equal(kf.quantize(x, kf.kv_format("f16")).numpy(), x.numpy().astype(np.float16))
    assert kf.quantize(x, kf.kv_format("f32")) is x


def _reference_dequant(blocks: np.ndarray, name: str) -> np.ndarray:
    """One block [block_bytes] of uint8 -> 32 float64 values, read from the layout as ggml-common.h gives it."""
    d = float(blocks[0:2].view(np.float16)[0])
    if name == "q8_0":
        return blocks[2:34].view(np.int8).astype(np.float64) * d
    affine, five = name.endswith("_1"), name.startswith("q5")
    m = float(blocks[2:4].view(np.float16)[0]) if affine else 0.0
    high = 2 + 2 * affine
    qs = blocks[high + 4 * five:]
    q = np.array([(qs[i % 16] >> (4 * (i // 16))) & 15 for i in range(32)], dtype=np.int64)
    if five:
        bits = int.from_bytes(bytes(blocks[high:high + 4]), "little")
        q |= np.array([((bits >> i) & 1) << 4 for i in range(32)], dtype=np.int64)
    return q * d + m if affine else (q - (16 if five else 8)) * d


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequantize_is_exact(name, gguf_py):
    """The values are those of gguf-py's blocks read as ggml-common.h lays them out, bit for bit."""
    quantize, GGMLQuantizationType = gguf_py
    fmt = kf.kv_format(name)
    x = _rows(3, (2, 3, 64))
    stored = kf.quantize(x, fmt)
    got = kf.dequantize_rows(stored, fmt, torch.float32).double().numpy().reshape(-1, 32)
    blocks = quantize(x.reshape(-1, 64).numpy(), getattr(GGMLQuantizationType, name.upper()))
    ref = np.stack([_reference_dequant(b, name) for b in blocks.reshape(-1, BLOCK_BYTES[name])])
    assert np.array_equal(got, ref)
    bf16 = kf.dequantize_rows(stored, fmt, torch.bfloat16)
    assert torch.equal(bf16, torch.from_numpy(ref).float().reshape(bf16.shape).to(torch.bfloat16))


def test_unknown_types_and_head_sizes_are_named():
    with pytest.raises(ValueError, match="unknown KV cache type 'iq4_nl'; supported: f32, f16, bf16, q8_0, q5_1"):
        kf.kv_format("iq4_nl")
    with pytest.raises(ValueError, match="q4_0 needs a head_dim that is a multiple of 32, got 48"):
        kf.quantize(torch.zeros(2, 48), kf.kv_format("q4_0"))


class _Shape:  # a ModelConfig's cache fields
    def __init__(self, layers, heads, head_dim):
        self.num_hidden_layers, self.num_key_value_heads, self.head_dim = layers, heads, head_dim


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q4_0"), ("q5_0", "q4_1"), ("q5_1", "f16"), (None, "bf16")])
def test_memory_per_token(k_type, v_type):
    cache = KVCache(_Shape(3, 2, 64), 10, torch.device("cpu"), torch.float32, k_type, v_type)

    def row_bytes(name):  # one kv head's row of 64 values
        return 4 * 64 if name is None else {"f16": 128, "bf16": 128}.get(name) or 2 * BLOCK_BYTES[name]

    assert cache.bytes_per_token() == 3 * 2 * (row_bytes(k_type) + row_bytes(v_type))
    assert cache.nbytes() == 10 * cache.bytes_per_token()


def test_writes_quantize_and_reads_dequantize():
    cache = torch.zeros(2, 10, kf.kv_format("q4_1").row_width(64), dtype=torch.uint8)
    rows = _rows(4, (2, 3, 64))
    kf.write_rows(cache, torch.tensor([7, 2, 5]), rows)
    assert torch.equal(cache[:, [7, 2, 5]], kf.quantize(rows, kf.kv_format("q4_1")))
    assert torch.equal(kf.read_rows(cache, 64, torch.float32)[:, [7, 2, 5]], kf.as_stored(rows, cache))
    assert not cache[:, [0, 1, 3, 4, 6, 8, 9]].any()


# Engines on a tiny Qwen3 whose heads are 32 wide (the block types need a multiple of 32).

@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    target = build_target(tmp_path_factory.mktemp("qwen3_hd32"), hidden=128, seed=4)
    return target, build_drafter(tmp_path_factory.mktemp("drafter_hd32"), target, block_size=8, seed=5)


def _prompts(vocab, count, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (count,), generator=g)]


@pytest.mark.parametrize("types", [("q8_0", "q8_0", "q4_0", "q4_0"), ("q5_0", "q4_1", None, None),
                                   ("q4_0", "q5_1", "q8_0", "q5_0"), ("f16", "bf16", "bf16", "f16")])
def test_greedy_dflash_equals_plain_for_each_type(wide_pair, types):
    engine = Engine.load(*wide_pair, device="cpu", context_size=128, cache_type_k=types[0], cache_type_v=types[1],
                         draft_cache_type_k=types[2], draft_cache_type_v=types[3])
    seq = engine.new_sequence()
    assert (seq.target_cache.k_format.name, seq.target_cache.v_format.name) == (types[0], types[1])
    assert (seq.draft_cache.k_format.name, seq.draft_cache.v_format.name) == (types[2] or "f32", types[3] or "f32")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in _prompts(engine.decoder.target.config.vocab_size, 3, seed=len(types[0])):
        base = engine.generate(prompt, params, draft=0)
        assert engine.generate(prompt, params, draft=engine.max_draft).tokens == base.tokens
    sampled = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=11)
    assert engine.generate(prompt, sampled, draft=0).tokens == engine.generate(prompt, sampled, draft=7).tokens


def test_engine_refuses_bad_types_at_load(wide_pair, qwen3_dir):
    with pytest.raises(ValueError, match="unknown KV cache type 'q3_k'; supported"):
        Engine.load(*wide_pair, device="cpu", context_size=64, draft_cache_type_v="q3_k")
    with pytest.raises(ValueError, match="q8_0 needs a head_dim that is a multiple of 32, got 16"):
        Engine.load(qwen3_dir, None, device="cpu", context_size=64, cache_type_k="q8_0")


def test_prefix_copy_and_rollback_in_a_quantized_cache(wide_pair):
    """Positions copied from another sequence's cache, and rows rolled back and rewritten, give a continuation
    bitwise the logits of a cache that held only the right rows."""
    engine = Engine.load(wide_pair[0], None, device="cpu", context_size=96, cache_type_k="q5_0", cache_type_v="q4_1")
    target = engine.decoder.target
    ids = torch.randint(5, target.config.vocab_size, (60,), generator=torch.Generator().manual_seed(9))
    P = 40
    with torch.no_grad():
        a = target.new_cache(96, "q5_0", "q4_1")
        target(ids[:P], torch.arange(P), a, P)
        b = target.new_cache(96, "q5_0", "q4_1")
        assert a.reusable(P) == P
        b.copy_prefix(a, P)
        assert all(torch.equal(x[:, :P], y[:, :P]) for x, y in zip(a.k + a.v, b.k + b.v))
        junk = torch.flip(ids[P:], [0])
        target(junk[:7], torch.arange(P, P + 7), a, P + 7)  # a rejected block, then rolled back to P
        tail = torch.arange(P, 60)
        assert torch.equal(target(ids[P:], tail, a, 60)[0], target(ids[P:], tail, b, 60)[0])
        with pytest.raises(ValueError, match="cannot copy a prefix from a q5_0/q4_1 cache into a f32/f32 one"):
            target.new_cache(96).copy_prefix(a, P)


def test_gemma4_rings_store_their_types(tmp_path):
    """Gemma 4: sliding rings and full layers take the cache types; a ring rolled back across its wrap gives the
    logits of one pass over the right tokens (within float noise), and its memory per token counts full layers."""
    from test_gemma4_tiny import randomise, text_config

    from flashdraft.models.gemma4.config import Gemma4Config
    from flashdraft.models.gemma4.model import Gemma4LM
    cfg = Gemma4Config.from_dict(dict(text_config(300, moe=False, window=8), model_type="gemma4_text", head_dim=32,
                                      global_head_dim=64))
    model = Gemma4LM(cfg).eval()
    randomise(model, 3)
    cache = model.new_cache(64, "q8_0", "q5_1")
    full = [i for i in range(cfg.num_hidden_layers) if not cfg.is_sliding(i)]
    assert cache.bytes_per_token() == len(full) * 1 * 2 * (BLOCK_BYTES["q8_0"] + BLOCK_BYTES["q5_1"])
    assert all(t.dtype == torch.uint8 for t in cache.k + cache.v)
    ids = torch.randint(5, 300, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, torch.arange(40), model.new_cache(64, "q8_0", "q5_1"), 40)[0]
        got = [model(ids[:10], torch.arange(10), cache, 10)[0]]
        i = 10
        while i < 40:  # blocks of 6 rows, the last 6 - keep of them junk and rolled back
            keep = min(i % 4 + 1, 40 - i)
            block = torch.cat([ids[i:i + keep], torch.flip(ids, [0])[:6 - keep]])
            got.append(model(block, torch.arange(i, i + 6), cache, i + 6)[0][:keep])
            i += keep
    assert (torch.cat(got) - ref).abs().max().item() < 1e-3


# The embedded demo pair (head_dim 64).

@pytest.fixture(scope="module")
def demo_paths():
    from flashdraft.demo import demo_paths
    return demo_paths()


HELD_OUT = (Path(__file__).parent / "tiny_models.py").read_text()  # code the demo pair was not trained on


def test_demo_pair_dflash_equals_plain_with_the_walkthrough_types(demo_paths):
    """DFlash gives plain decoding's tokens over quantized caches. On the CPU a 16-row verify pass does not round
    as a 1-row decode step does (the GPU kernels do: test_decode_attention, perf_run.py), so the outputs may part
    at a near-tie, and only there: where they first differ, the target's two best logits must be within 1e-3 and
    be the two tokens."""
    engine = Engine.load(*demo_paths, device="cpu", context_size=512, cache_type_k="q5_0", cache_type_v="q4_1",
                         draft_cache_type_k="q8_0", draft_cache_type_v="q8_0")
    prompt = engine.encode_prompt(HELD_OUT[:400])
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    base = engine.generate(prompt, params, draft=0)
    dflash = engine.generate(prompt, params, draft=engine.max_draft)
    assert dflash.stats.tau > 1.5
    if dflash.tokens == base.tokens:
        return
    i = next(i for i, (a, b) in enumerate(zip(base.tokens, dflash.tokens)) if a != b)
    target = engine.decoder.target
    ids = torch.tensor(prompt + base.tokens[:i])
    with torch.no_grad():
        logits, _ = target(ids, torch.arange(len(ids)), target.new_cache(len(ids), "q5_0", "q4_1"), len(ids))
    best = logits[-1].topk(2)
    assert best.values[0] - best.values[1] < 1e-3, (i, best)
    assert {base.tokens[i], dflash.tokens[i]} == set(best.indices.tolist())


def agreement(model, ids: torch.Tensor, k_type: str | None, v_type: str | None) -> tuple[torch.Tensor, float]:
    """Next-token argmax over a text with one cache type, and the text's mean negative log-likelihood."""
    with torch.no_grad():
        logits, _ = model(ids, torch.arange(len(ids)), model.new_cache(len(ids), k_type, v_type), len(ids))
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).item()
    return logits.argmax(-1), nll


def test_demo_pair_q8_0_agrees_with_the_float_cache(demo_paths):
    engine = Engine.load(demo_paths[0], None, device="cpu", context_size=1024)
    ids = torch.tensor(engine.encode_prompt(HELD_OUT)[:1000])
    target = engine.decoder.target
    ref, ref_nll = agreement(target, ids, None, None)
    q8, q8_nll = agreement(target, ids, "q8_0", "q8_0")
    q4, q4_nll = agreement(target, ids, "q4_0", "q4_0")
    same_q8, same_q4 = (q8 == ref).float().mean().item(), (q4 == ref).float().mean().item()
    assert same_q8 > 0.97 and abs(q8_nll - ref_nll) < 0.02
    assert same_q4 < 1.0 and same_q4 <= same_q8 + 0.005  # 4-bit keys do change the output, and not for the better


# The Triton paths under Triton's interpreter on the CPU (compiled on a CUDA machine).

triton = pytest.importorskip("triton")
from triton_interpreter import interpret_without_gpu  # noqa: E402

from flashdraft.layers import decode_attention as da  # noqa: E402
from flashdraft.layers import qkv_prep as qp  # noqa: E402
from flashdraft.layers.attention import grouped_attention  # noqa: E402

interpret_without_gpu("flashdraft.kernels.attention_triton", da._kernels)
interpret_without_gpu("flashdraft.kernels.qkv_prep_triton", qp._kernels)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q4_0"), ("q4_1", "q5_0"), ("q5_1", "f16")])
def test_attention_kernel_dequantizes_the_blocks(k_type, v_type):
    """decode_attention over packed rows is bitwise decode_attention over their dequantized values (the kernel
    dequantizes as kv_formats does), and SDPA's attention over them within float noise."""
    T, kv_len = 3, 70
    q = _rows(5, (4, T, 32)).to(DEVICE)
    k, v = _rows(6, (2, kv_len, 32)).to(DEVICE), _rows(7, (2, kv_len, 32)).to(DEVICE)
    kt, vt = kf.kv_format(k_type), kf.kv_format(v_type)
    pk, pv = kf.quantize(k, kt), kf.quantize(v, vt)
    dk, dv = kf.dequantize_rows(pk, kt, torch.float32), kf.dequantize_rows(pv, vt, torch.float32)
    mask = (torch.arange(kv_len)[None, :] <= torch.arange(kv_len - T, kv_len)[:, None]).to(DEVICE)
    packed = da.launch(q, pk, pv, mask)
    assert torch.equal(packed, da.launch(q, dk, dv, mask))
    ref = grouped_attention(q.double()[None], dk.double()[None], dv.double()[None], mask[None, None])
    assert (packed - ref[0].transpose(0, 1).reshape(T, -1)).abs().max().item() < 1e-3


@pytest.mark.parametrize("k_type,v_type", [("q5_1", "f16"), ("q5_0", "q4_1")])
def test_fused_cache_writes_store_the_types(wide_pair, k_type, v_type):
    """Attention's fused path (qkv_prep) writes a cache of block types in the kernel, and a float cache of another
    dtype than the compute one through rows of the compute dtype: either way the bytes are those of the eager
    path's rows, stored in the cache's type."""
    from flashdraft.models import load_target
    attn = load_target(wide_pair[0], 0, device=DEVICE, dtype=torch.float32).model.layers[0].self_attn
    T, hd = 5, attn.head_dim
    qkv = _rows(8, (T, (attn.n_heads + 2 * attn.n_kv) * hd)).to(DEVICE)
    cos, sin = torch.rand(T, hd, device=DEVICE), torch.rand(T, hd, device=DEVICE)
    positions = torch.tensor([3, 4, 5, 6, 7], device=DEVICE)
    kt, vt = kf.kv_format(k_type), kf.kv_format(v_type)
    ck, cv = kf.new_rows(kt, attn.n_kv, 16, hd, DEVICE), kf.new_rows(vt, attn.n_kv, 16, hd, DEVICE)
    q = attn._prep_into_cache(qkv, cos, sin, positions, ck, cv, attn.n_heads, None, None, 1e-6)
    rk, rv = torch.zeros(attn.n_kv, 16, hd, device=DEVICE), torch.zeros(attn.n_kv, 16, hd, device=DEVICE)
    ref_q = qp.qkv_prep_reference(qkv, cos, sin, positions, rk, rv, attn.n_heads, attn.n_kv)
    assert torch.equal(q, ref_q)
    for cache, ref, fmt in ((ck, rk, kt), (cv, rv, vt)):
        assert torch.equal(cache[:, positions], kf.quantize(ref[:, positions], fmt))
        assert not cache[:, 8:].any()  # rows not written keep their zeros


def test_routed_layers_read_quantized_caches(wide_pair):
    """Cached passes routed to decode_attention read a q8_0 / q4_1 cache as the SDPA path does."""
    from flashdraft.layers import LayerPlan
    from flashdraft.models import load_target
    outs, caches = [], []
    for attention in ("sdpa", "triton"):
        target = load_target(wide_pair[0], 64, device=DEVICE, dtype=torch.float32,
                             plan=LayerPlan(attention=attention))
        assert target.model.layers[0].self_attn.attention_rows == (16 if attention == "triton" else 0)
        ids = torch.randint(5, target.config.vocab_size, (24,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
        cache = target.new_cache(32, "q8_0", "q4_1")
        with torch.no_grad():
            target(ids[:20], torch.arange(20, device=DEVICE), cache, 20)  # prefill: SDPA either way
            outs.append(target(ids[20:], torch.arange(20, 24, device=DEVICE), cache, 24)[0])
        caches.append(cache)
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])


def _tiny_gemma4s(*plans):
    """Random tiny Gemma 4s with the same weights, one per plan (None: the module path), prepared for it, on
    DEVICE; heads of 32 and 64, wide enough for KV caches of block types."""
    from test_gemma4_tiny import randomise, text_config

    from flashdraft.models.gemma4.config import Gemma4Config
    from flashdraft.models.gemma4.model import Gemma4LM
    cfg = Gemma4Config.from_dict(dict(text_config(300, moe=False, window=8, head_dim=32), model_type="gemma4_text"))
    models = []
    for plan in plans:
        model = (Gemma4LM(cfg) if plan is None else Gemma4LM(cfg, plan)).eval()
        if models:
            model.load_state_dict(models[0].state_dict())
        else:
            randomise(model, 4)
        model.to(DEVICE)
        if plan is not None:
            model.prepare()
        models.append(model)
    return models


def _logits_in_passes(model, ids):
    """The logits of ids, and the cache of the walkthrough's types they went through: a 20-token pass (more rows
    than the kernels take), then passes of 5 tokens, past the sliding layers' ring."""
    cache, parts = model.new_cache(64, "q5_0", "q4_1"), []
    with torch.no_grad():
        parts.append(model(ids[:20], torch.arange(20, device=DEVICE), cache, 20)[0])
        for i in range(20, len(ids), 5):
            parts.append(model(ids[i:i + 5], torch.arange(i, i + 5, device=DEVICE), cache, i + 5)[0])
    return torch.cat(parts), cache


def test_gemma4_few_row_passes_write_the_types_in_qkv_prep():
    """Gemma 4 with the GPU's plan (q/k/v as one product; few-row passes through qkv_prep, which quantizes as it
    writes, and decode_attention) into caches of the walkthrough's types, past the sliding layers' ring: one
    qkv_prep launch a layer and pass, and the logits of the module path over caches of the same types (within
    what a value moved one quantization step by an ulp's difference before quantizing gives)."""
    from flashdraft.layers import LayerPlan
    modules, routed = _tiny_gemma4s(None, LayerPlan(attention="triton", fuse_projections=True))
    ids = torch.randint(5, 300, (40,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    logits, launches, real = [], [], qp.launch
    qp.launch = lambda *a, **kw: launches.append(a[0].shape[0]) or real(*a, **kw)
    try:
        logits = [_logits_in_passes(model, ids)[0] for model in (modules, routed)]
    finally:
        qp.launch = real
    assert launches == [5] * 4 * routed.config.num_hidden_layers
    assert (logits[0] - logits[1]).abs().max().item() < 1e-2


def test_gemma4_compiled_layers_write_the_types_in_qkv_prep():
    """Gemma 4's layers compiled as the engine compiles them (dynamic shapes; aot_eager here: Dynamo's tracing, the
    ops' fake implementations and functionalization of the cache writes, without Inductor's minutes on the CPU)
    over caches of the walkthrough's types: the eager layers' logits and cache bytes. Under dynamic shapes a
    block-type cache's row width is symbolic, which qkv_prep's fake implementation must not look up."""
    from flashdraft.layers import LayerPlan
    from flashdraft.models.gemma4.model import Gemma4DecoderLayer
    plan = LayerPlan(attention="triton", fuse_projections=True)
    models = _tiny_gemma4s(plan, plan)
    for m in models[1].modules():
        if isinstance(m, Gemma4DecoderLayer):
            m.compile(dynamic=True, backend="aot_eager")
    ids = torch.randint(5, 300, (30,), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    (eager, eager_cache), (compiled, compiled_cache) = (_logits_in_passes(model, ids) for model in models)
    assert torch.equal(eager, compiled)
    for a, b in zip(eager_cache.k + eager_cache.v, compiled_cache.k + compiled_cache.v):
        assert a.dtype == torch.uint8 and torch.equal(a, b)


def test_serve_takes_the_cache_type_flags(tmp_path, capsys):
    from flashdraft.server.cli import build_parser, main as serve_main, settings_from_args

    (tmp_path / "config.json").write_text("{}")  # only the flags are parsed; no model is loaded
    args = build_parser().parse_args(["-m", str(tmp_path), "-ctk", "q5_0", "--cache-type-v", "q4_1",
                                      "-ctkd", "q8_0", "--spec-draft-type-v", "f16", "-ngl", "99",
                                      "--spec-dflash-cross-ctx", "1024"])
    assert settings_from_args(args).cache_options == {"cache_type_k": "q5_0", "cache_type_v": "q4_1",
                                                      "draft_cache_type_k": "q8_0", "draft_cache_type_v": "f16",
                                                      "draft_window": 1024, "prefill_chunk": None}
    assert args.no_effect == ["-ngl 99"]  # the cache flags are not among the flags that do nothing
    assert serve_main(["-m", str(tmp_path), "-ctk", "q3_k"]) == 2
    err = capsys.readouterr().err
    assert "-ctk" in err and "q4_0" in err  # argparse names the flag and the supported types
