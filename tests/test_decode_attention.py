"""The batch-invariant split-KV attention (flashdraft.layers.decode_attention): its Triton kernels under Triton's
interpreter on the CPU (compiled on a CUDA machine), against SDPA; its invariance; the custom op; the engine's
attention option. scripts/gpu/perf_run.py checks the GPU kernels at the real shapes."""

from dataclasses import replace

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

pytest.importorskip("triton")

from triton_interpreter import generate_through, interpret_without_gpu  # noqa: E402

from flashdraft.layers import decode_attention as da  # noqa: E402
from flashdraft.layers.attention import grouped_attention  # noqa: E402

interpret_without_gpu("flashdraft.kernels.attention_triton", da._kernels)


def _cache(kv_heads, rows, hd, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(kv_heads, rows, hd, generator=g).to(DEVICE),
            torch.randn(kv_heads, rows, hd, generator=g).to(DEVICE))


def _queries(heads, T, hd, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, heads, hd, generator=g).to(DEVICE).transpose(0, 1)  # [heads, T, hd], as Attention has it


def _reference(q, k, v, mask):
    """SDPA in float64 over the same rows, in decode_attention's output layout [T, heads * hd]."""
    m = None if mask is None else mask[None, None]
    out = grouped_attention(q.double()[None], k.double()[None], v.double()[None], m)
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


def _causal(start, T, kv_len, window=None):
    pos = torch.arange(start, start + T, device=DEVICE)[:, None]
    keys = torch.arange(kv_len, device=DEVICE)[None, :]
    mask = keys <= pos
    return mask & (pos - keys < window) if window else mask


# (heads, kv_heads, head_dim, T, kv_len, mask): decode and verify over more than one key range (SPLIT = 128), a
# kv_len that is not a multiple of the range, grouped and plain multi-head, a sliding window, a mask shared by
# the rows (the drafter's block), no mask.
CASES = [
    (8, 2, 64, 1, 300, "causal"),
    (8, 2, 64, 16, 300, "causal"),
    (4, 4, 128, 5, 129, "causal"),
    (8, 2, 64, 6, 260, "window"),
    (8, 2, 64, 4, 200, "shared"),
    (8, 1, 64, 3, 70, None),
    (6, 2, 32, 7, 150, "causal"),  # 3 heads per kv head: a token's rows cross a 16-row tile
]


@pytest.mark.parametrize("heads,kv_heads,hd,T,kv_len,mask_kind", CASES)
def test_matches_sdpa(heads, kv_heads, hd, T, kv_len, mask_kind):
    k, v = _cache(kv_heads, kv_len + 20, hd, seed=heads * kv_len)
    k[:, kv_len:], v[:, kv_len:] = float("nan"), float("nan")  # rows past kv_len must not be read
    q = _queries(heads, T, hd, seed=T)
    start = kv_len - T - 3
    mask = {"causal": _causal(start, T, kv_len), "window": _causal(start, T, kv_len, window=50),
            "shared": _causal(start + T - 1, 1, kv_len), None: None}[mask_kind]
    out = da.launch(q, k[:, :kv_len], v[:, :kv_len], mask)
    assert out.shape == (T, heads * hd) and out.dtype == q.dtype
    ref = _reference(q, k[:, :kv_len], v[:, :kv_len], None if mask is None else mask.expand(T, kv_len))
    assert (out.double() - ref).abs().max().item() < 1e-5


# key ranges of 32 keys: 8 to 13 ranges to combine
MANY_RANGES = da.AttentionConfig(block_n=32, split=32)
# a kv head's whole verify block in one query tile (16 tokens x a group of 4 heads): the keys of a range read once
# for every row (issue #20), the tile the same for every T
WHOLE_BLOCK = da.AttentionConfig(block_q=64, block_n=32, split=64)
# the key loop as a loop Triton pipelines rather than unrolled: the same arithmetic in the same order
PIPELINED = da.AttentionConfig(block_n=32, split=96, pipelined=True)


@pytest.mark.parametrize("config, window", [(None, None), (MANY_RANGES, None), (MANY_RANGES, 100),
                                            (WHOLE_BLOCK, None), (WHOLE_BLOCK, 100), (PIPELINED, 100)],
                         ids=["default", "many-ranges", "many-ranges-window", "whole-block", "whole-block-window",
                              "pipelined-window"])
def test_rows_are_bitwise_independent_of_the_other_tokens(config, window):
    """A token's rows are the same bits whether it goes alone (as the first token) or with up to 15 more, and
    whatever the other tokens hold; also over many key ranges, the leading ones hidden by a sliding window.
    (A token in another row of the block lands in other places of the query tile; tensor cores make that
    irrelevant on the GPU, where perf_run.py checks it; the interpreter's BLAS does not promise it, so here the
    token keeps its place.)"""
    k, v = _cache(2, 300, 64, seed=7)
    q = _queries(8, 16, 64, seed=8)
    mask = _causal(250, 16, 300, window=window)
    full = da.launch(q, k, v, mask, config)
    for T in (1, 3, 7):
        assert torch.equal(da.launch(q[:, :T].contiguous(), k, v, mask[:T], config), full[:T])
    other = q.clone()
    other[:, 1:] = _queries(8, 15, 64, seed=9)
    assert torch.equal(da.launch(other, k, v, mask, config)[0], full[0])
    ref = _reference(q, k, v, mask)
    torch.testing.assert_close(full.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config", [None, MANY_RANGES, WHOLE_BLOCK, PIPELINED],
                         ids=["default", "many-ranges", "whole-block", "pipelined"])
def test_rows_do_not_depend_on_the_graph_bucket(config):
    """A verify step may attend over a longer kv_len (the next graph bucket) than the decode step of the same
    token: the rows past its position are hidden, and its output bits stay the same (also over many key
    ranges)."""
    k, v = _cache(2, 400, 64, seed=12)
    q = _queries(8, 4, 64, seed=13)
    short, longer = da.launch(q, k[:, :256], v[:, :256], _causal(250, 4, 256), config), \
        da.launch(q, k[:, :400], v[:, :400], _causal(250, 4, 400), config)
    assert torch.equal(short, longer)
    ref = _reference(q, k[:, :256], v[:, :256], _causal(250, 4, 256))
    torch.testing.assert_close(short.double(), ref, rtol=1e-4, atol=1e-5)


def test_pipelined_key_loop_gives_the_unrolled_bits():
    """Pipelining the key loop changes when keys load, not the arithmetic: the same bits as the unrolled loop of
    the same tiling, over a partly filled last range and a sliding window."""
    k, v = _cache(2, 300, 64, seed=31)
    q = _queries(8, 16, 64, seed=32)
    mask = _causal(250, 16, 300, window=100)
    unrolled = replace(PIPELINED, pipelined=False)
    assert torch.equal(da.launch(q, k, v, mask, PIPELINED), da.launch(q, k, v, mask, unrolled))


def test_long_caches_take_longer_key_ranges():
    """The tiling follows the cache's capacity (rows per kv head as allocated), never kv_len or T: over a view of
    a 7000-row cache the rows get 512-key ranges (a pipelined loop), still bitwise the same alone or with other
    tokens, and over a longer kv_len."""
    assert da.config_for(128, 4112) is da.CONFIG and da.config_for(64, 300) is da.CONFIG
    assert da.config_for(128, 7000).split == 512 and da.config_for(128, 8208).split == 512
    assert da.config_for(128, 32912).split == 1024 and da.config_for(256, 40000) is da.WIDE_HEAD_CONFIG
    # where the launch can take tensor descriptors the long tilings do (the same bits: the test below), short ones not
    assert da.config_for(128, 8208, descriptors=True) == replace(da.config_for(128, 8208), tma=True)
    assert da.config_for(128, 32912, descriptors=True).tma and not da.config_for(128, 32912).tma
    assert not da.config_for(128, 4112, descriptors=True).tma
    # Gemma 4's 512-wide full layers: 32-key steps, 128-key ranges up to 24576 rows, 1024-key ranges beyond
    assert da.config_for(512, 4112) is da.WIDEST_HEAD_CONFIG and da.config_for(512, 8208) is da.WIDEST_HEAD_CONFIG
    assert (da.config_for(512, 24592).split, da.config_for(512, 131136).split) == (1024, 1024)
    assert da.config_for(512, 131136).block_n == 32 and da.config_for(128, 32912).pipelined
    # float32 caches of 512-wide heads: one step in shared memory at a time, the same arithmetic
    assert da.config_for(512, 131136, 4) == replace(da.WIDEST_LONG_CONFIG, num_stages=1)
    k, v = _cache(2, 7000, 64, seed=21)
    q = _queries(8, 16, 64, seed=22)
    mask = _causal(250, 16, 300)
    full = da.launch(q, k[:, :300], v[:, :300], mask)
    assert torch.equal(da.launch(q[:, :1].contiguous(), k[:, :300], v[:, :300], mask[:1]), full[:1])
    longer = da.launch(q[:, :1].contiguous(), k[:, :600], v[:, :600], _causal(250, 1, 600))
    assert torch.equal(longer, full[:1])
    assert not torch.equal(full, da.launch(q, k[:, :300].contiguous(), v[:, :300].contiguous(), mask))
    torch.testing.assert_close(full.double(), _reference(q, k[:, :300], v[:, :300], mask), rtol=1e-4, atol=1e-5)
    # beyond 24576 rows a kv head's whole verify block in one 64-row tile (16 tokens x a group of 4), the key loop
    # pipelined: a token alone, with the others and over a longer kv_len, the same bits
    whole = da.config_for(128, 32912)
    assert (whole.block_q, whole.block_n, whole.split, whole.pipelined) == (64, 64, 1024, True)
    k, v = _cache(2, 32912, 128, seed=23)
    q = _queries(8, 16, 128, seed=24)
    full = da.launch(q, k[:, :300], v[:, :300], mask)
    assert torch.equal(da.launch(q[:, :3].contiguous(), k[:, :300], v[:, :300], mask[:3]), full[:3])
    assert torch.equal(da.launch(q[:, :1].contiguous(), k[:, :600], v[:, :600], _causal(250, 1, 600)), full[:1])
    torch.testing.assert_close(full.double(), _reference(q, k[:, :300], v[:, :300], mask), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config", [PIPELINED, da.AttentionConfig(block_q=64, block_n=64, split=1024, num_warps=4,
                                                                   pipelined=True)],
                         ids=["pipelined", "whole-block-long-ranges"])
def test_descriptor_loads_give_the_tilings_bits(config):
    """A tiling with tensor-descriptor loads (tma) reads the same keys and values as its loads by address, rows
    past kv_len as zeros (here NaN in the cache: never read as such), so a token gets the same bits; over a view of
    a larger cache (the strides as allocated), one token and a verify block. Quantized caches are refused by
    name."""
    k, v = _cache(2, 340, 64, seed=51)
    k[:, 300:], v[:, 300:] = float("nan"), float("nan")
    q = _queries(8, 16, 64, seed=52)
    tma = replace(config, tma=True)
    assert tma.name == config.name + "t"
    for T, kv_len in ((16, 300), (1, 170)):
        mask = _causal(kv_len - T, T, kv_len)
        keys, values = k[:, :kv_len], v[:, :kv_len]
        out = da.launch(q[:, :T].contiguous(), keys, values, mask, tma)
        assert torch.equal(out, da.launch(q[:, :T].contiguous(), keys, values, mask, config))
        assert not out.isnan().any()
    packed = torch.zeros(2, 64, 64 + 4, dtype=torch.uint8, device=DEVICE)  # q8_0 rows
    with pytest.raises(ValueError, match="tensor descriptors"):
        da.launch(q[:, :1].contiguous(), packed, packed, None, tma)
    # the launch's own choice over a long cache of packed rows loads them by address, refusing nothing
    packed = torch.zeros(2, 7000, 64 + 4, dtype=torch.uint8, device=DEVICE)
    assert not da.launch(q[:, :1].contiguous(), packed[:, :300], packed[:, :300], None).isnan().any()


@pytest.mark.parametrize("config", [None, MANY_RANGES, WHOLE_BLOCK, PIPELINED],
                         ids=["default", "many-ranges", "whole-block", "pipelined"])
def test_the_few_row_combine_gives_the_one_pass_bits(config):
    """The last program adds one token's rows eight key ranges at a time (ranges past the last read as hidden)
    and more rows one range after another: the same additions in the same order, so the same bits, over 10 ranges
    (not a multiple of eight) for one token (the few-row combine), a few and a verify block (one pass), with a
    sliding window that hides the first ranges."""
    c = config or da.config_for(64)
    assert c.few_rows(64, 4) == 4 and replace(c, few_row_combine=False).few_rows(64, 4) == 0
    k, v = _cache(2, 320, 64, seed=61)
    q = _queries(8, 16, 64, seed=62)
    for T, window in ((1, None), (3, 100), (16, None)):
        mask = _causal(320 - T, T, 320, window=window)
        few = da.launch(q[:, :T].contiguous(), k, v, mask, c)
        assert torch.equal(few, da.launch(q[:, :T].contiguous(), k, v, mask, replace(c, few_row_combine=False)))
        torch.testing.assert_close(few.double(), _reference(q[:, :T], k, v, mask), rtol=1e-4, atol=1e-5)


def test_few_rows_fit_the_registers():
    """The few-row combine holds eight ranges' partials of one token's rows (the group rounded up to a power of
    two) in at most 64 registers a thread: Qwen3-8B's 4 rows of 128, Gemma 4's sliding layers' 2 of 256; none for
    Gemma 4's 512-wide full layers (8 rows: 128 registers on 8 warps)."""
    assert da.config_for(128).few_rows(128, 4) == 4
    assert da.config_for(128, capacity=32960).few_rows(128, 4) == 4
    assert da.config_for(256).few_rows(256, 2) == 2
    assert da.config_for(128).few_rows(128, 3) == 4
    assert da.config_for(512).few_rows(512, 8) == 0


def test_another_tiling_changes_the_bits():
    """The invariance checks can fail: a tiling chosen by T (here another key range) changes a token's bits."""
    k, v = _cache(2, 300, 64, seed=3)
    q = _queries(8, 16, 64, seed=4)
    mask = _causal(250, 16, 300)
    full = da.launch(q, k, v, mask)
    alone = da.launch(q[:, :1].contiguous(), k, v, mask[:1], da.AttentionConfig(split=64, block_n=32))
    assert not torch.equal(alone, full[:1])
    assert (alone - full[:1]).abs().max().item() < 1e-5  # same attention, other rounding


def test_bad_shapes_are_named():
    k, v = _cache(2, 64, 64, seed=1)
    with pytest.raises(ValueError, match="head_dim"):
        da.launch(_queries(8, 1, 64, 1)[..., :48], k[..., :48], v[..., :48], None)
    with pytest.raises(ValueError, match="mask"):
        da.launch(_queries(8, 2, 64, 1), k, v, torch.ones(3, 64, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="boolean"):
        da.launch(_queries(8, 2, 64, 1), k, v, torch.zeros(2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="heads"):
        da.launch(_queries(6, 1, 64, 1), _cache(4, 64, 64, 1)[0], _cache(4, 64, 64, 1)[1], None)


def test_custom_op_and_compile():
    k, v = _cache(2, 140, 64, seed=5)
    q = _queries(8, 4, 64, seed=6)
    mask = _causal(130, 4, 140)
    torch.library.opcheck(torch.ops.flashdraft.decode_attention.default, (q, k, v, mask),
                          test_utils=("test_schema", "test_faketensor"))

    def f(q, mask):
        return da.decode_attention(q, k, v, mask) * 2

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (1, 4):
        assert torch.equal(compiled(q[:, :T], mask[:T]), f(q[:, :T], mask[:T]))


def test_engine_attention_option(qwen3_dir, drafter_dir):
    """attention="triton" sends the target's and the drafter's decode, verify and draft passes through the
    kernels, and greedy output (plain and DFlash) equals the SDPA engine's on this tiny float32 model."""
    from flashdraft.config import SamplingParams
    from flashdraft.engine.generator import Engine

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = list(range(3, 40))
    plain = Engine.load(qwen3_dir, drafter_dir, device=DEVICE, context_size=96, gemm="cublas", attention="sdpa")
    ref = plain.generate(prompt, params, 0).tokens
    eng = Engine.load(qwen3_dir, drafter_dir, device=DEVICE, context_size=96, gemm="cublas", attention="triton")
    assert eng.decoder.plan.attention == "triton"
    calls = generate_through(da, "_decode_attention", eng, prompt, params, ref, lambda q: tuple(q.shape[1:2]))
    if calls is None:
        return
    block = eng.decoder.block_size
    assert (1,) in calls and (block,) in calls  # decode steps and drafter blocks
    assert any(1 < t[0] < block for t in calls)  # verify steps of fewer guesses (drafting 3)
    assert all(t[0] <= max(16, block) for t in calls)  # the 37-token prefill stayed on SDPA


def test_resolve_attention(monkeypatch):
    from flashdraft.engine import model_prep
    from flashdraft.engine.model_prep import resolve_attention, resolve_gemm
    assert resolve_attention(None, torch.device("cpu")) == "sdpa"  # the interpreter is opt-in only
    assert resolve_attention(None, torch.device("cuda")) == resolve_gemm(None, torch.device("cuda")) == "triton"
    monkeypatch.setattr(model_prep, "triton_available", lambda: False)
    assert (resolve_attention(None, torch.device("cuda")), resolve_gemm(None, torch.device("cuda"))) == \
        ("sdpa", "cublas")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_attention("flash", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs Triton and a CUDA device"):
        resolve_attention("triton", torch.device("cpu"))


@pytest.mark.parametrize("hd, scale", [(512, 1.0), (64, 0.37)])
def test_head_width_512_and_a_given_scale(hd, scale):
    """Gemma 4's full layers: 512-wide heads and scores scaled by 1.0, not 1/sqrt(head_dim)."""
    k, v = _cache(1, 150, hd, seed=hd)
    q = _queries(8, 3, hd, seed=3) / hd ** 0.5
    mask = _causal(140, 3, 150)
    out = da.decode_attention(q, k, v, mask, scale=scale)
    # SDPA's default scale is 1/sqrt(hd): the same scores come from q * scale * sqrt(hd)
    ref = _reference(q.double() * scale * hd ** 0.5, k, v, mask)
    assert (out.double() - ref).abs().max().item() < 1e-5
    long = da.launch(q, k, v, mask, da.config_for(hd, 131136, k.element_size()), scale=scale)  # long key ranges
    assert (long.double() - ref).abs().max().item() < 1e-5


def _gemma4_decode(model, ids, block):
    cache, parts = model.new_cache(len(ids) + 8), []
    with torch.no_grad():
        parts.append(model(ids[:20], torch.arange(20, device=ids.device), cache, 20)[0])
        for i in range(20, len(ids), block):  # through the static caches and around the sliding layers' ring
            j = min(i + block, len(ids))
            parts.append(model(ids[i:j], torch.arange(i, j, device=ids.device), cache, j)[0])
    return torch.cat(parts)


@pytest.mark.parametrize("fused,moe", [(False, False), (True, False), (False, True)],
                         ids=["modules", "fused-qkv", "moe"])
def test_gemma4_routes_to_the_kernel(tmp_path, fused, moe):
    """Gemma 4's sliding (ring read in place) and full layers take decode_attention for few-row passes, with the
    logits of the SDPA path; longer passes stay on SDPA. With q/k/v as one projection (the GPU's plan), the
    few-row passes' norms, RoPE and cache writes are one qkv_prep launch a layer, with the same logits. Either
    way each few-row pass norms the first layer's input (rms_norm_rows.gemma_norm) and joins each layer's attention
    and feed-forward outputs to the residual with one kernel each (gemma_add_norm, gemma_add_scaled_norm: the
    latter also norms the next layer's input, the last layer's the final norm, so no other launch takes those); an
    MoE layer's norms of the residual (the router's, the experts' input), of the experts' output and the join of
    its two branches are one kernel each too (six launches a layer); without qkv_prep, each head's q, k and v
    norms."""
    from test_gemma4_target import LONG, WINDOW
    from test_gemma4_tiny import build_gemma4_target

    from flashdraft.layers import LayerPlan
    from flashdraft.layers import qkv_prep as qp
    from flashdraft.layers import rms_norm_rows as rn
    from flashdraft.models import load_target

    interpret_without_gpu("flashdraft.kernels.qkv_prep_triton", qp._kernels)
    interpret_without_gpu("flashdraft.kernels.rms_norm_triton", rn._kernels)
    folder, _ = build_gemma4_target(tmp_path, window=WINDOW, moe=moe)
    sdpa = load_target(folder, 0, device=DEVICE, dtype=torch.float32)
    routed = load_target(folder, 0, device=DEVICE, dtype=torch.float32,
                         plan=LayerPlan(attention="triton", fuse_projections=fused))
    routed.prepare()
    assert all(layer.self_attn.attention_rows == 16 for layer in routed.model.layers)
    ids = torch.randint(0, routed.config.vocab_size, (LONG,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    calls, preps, joins = [], [], []
    real, real_prep, real_join = da.launch, qp.launch, rn._gemma_launch
    da.launch = lambda *a, **kw: calls.append(a[0].shape[1]) or real(*a, **kw)
    qp.launch = lambda *a, **kw: preps.append((a[0].shape[0], kw["value_is_key"], kw["wrap"])) or real_prep(*a, **kw)
    rn._gemma_launch = lambda *a: joins.append(a[0].shape[0]) or real_join(*a)
    try:
        got = _gemma4_decode(routed, ids, 7)
    finally:
        da.launch, qp.launch, rn._gemma_launch = real, real_prep, real_join
    assert (got - _gemma4_decode(sdpa, ids, 7)).abs().max().item() < 1e-4
    assert set(calls) == {7, (LONG - 20) % 7 or 7}  # the 20-token prefill went to SDPA (more than max_t rows)
    # one launch a layer and few-row pass: sliding layers write a ring with their own values, full layers' values
    # are their keys (attention_k_eq_v in the tiny model)
    kinds = [(not layer.self_attn.sliding, layer.self_attn.sliding) for layer in routed.model.layers]
    # each few-row pass joins a layer's attention and then its feed-forward to the residual, one kernel a join
    assert all(layer.moe == moe for layer in routed.model.layers)
    # the first layer's input norm; a layer: [the modules path (q/k/v apart): each head's q, v and k norm, rows T x
    # heads], the attention's join, [MoE: the router's and the experts' input norms, the experts' output norm, the
    # branches' join], the feed-forward's join with the next input norm (the last one's with the final norm)
    def launches(T):
        per_layer = [([] if fused else [T * a.n_heads, T * a.n_kv, T * a.n_kv]) + [T] * (6 if moe else 2)
                     for a in (layer.self_attn for layer in routed.model.layers)]
        return [T] + [rows for layer in per_layer for rows in layer]
    assert joins == [rows for T in calls[::len(kinds)] for rows in launches(T)]
    assert preps == ([(T, *kind) for T in [7] * ((LONG - 20) // 7) + [(LONG - 20) % 7] * bool((LONG - 20) % 7)
                      for kind in kinds] if fused else [])


@pytest.mark.skipif(not ON_CUDA, reason="bitwise batch invariance is the GPU kernels' property")
@pytest.mark.parametrize("fused,moe", [(False, False), (True, False), (True, True)],
                         ids=["modules", "fused-qkv", "moe"])
def test_gemma4_target_rows_are_bitwise_independent_of_the_block(tmp_path, fused, moe):
    """What lossless greedy DFlash rests on for Gemma 4: a token's logits are the same bits verified inside a
    16-token block as decoded alone, in bf16 with the engine's CUDA settings (Triton GEMMs and attention, compiled
    layers; fused: q/k/v as one projection, the few-row passes through qkv_prep)."""
    from test_gemma4_target import WINDOW
    from test_gemma4_tiny import build_gemma4_target

    from flashdraft.engine.model_prep import compile_layers
    from flashdraft.layers import LayerPlan
    from flashdraft.models import load_target

    folder, _ = build_gemma4_target(tmp_path, window=WINDOW, moe=moe)
    model = load_target(folder, 0, device="cuda", dtype=torch.bfloat16,
                        plan=LayerPlan(gemm="triton", attention="triton", fuse_projections=fused))
    model.prepare()
    compile_layers(model)
    vocab, start = model.config.vocab_size, 3 * WINDOW + 5  # past the window and around the ring
    ids = torch.randint(0, vocab, (start + 16,), generator=torch.Generator().manual_seed(2)).cuda()
    cache = model.new_cache(start + 64)
    kv = start + 32  # both passes over the same (graph-bucket) length, as the engine runs them
    with torch.no_grad():
        model(ids[:start], torch.arange(start, device="cuda"), cache, start)
        block = model(ids[start:], torch.arange(start, start + 16, device="cuda"), cache, kv)[0]
        alone = [model(ids[start + i:start + i + 1], torch.tensor([start + i], device="cuda"), cache, kv)[0]
                 for i in range(16)]
    assert all(torch.equal(block[i], row[0]) for i, row in enumerate(alone))


@pytest.mark.parametrize("config", [None, MANY_RANGES, PIPELINED], ids=["default", "many-ranges", "pipelined"])
def test_one_launch_over_several_caches_gives_each_segment_its_own_launch(config):
    """Three sequences' rows (5, 1 and 16 tokens, other positions, kv_len and caches) in one launch
    (decode_attention_segments, a batched step's layer): each row's bits are its own sequence's launch alone over
    its own cache and kv_len (the merged launch reads the longest kv_len, its mask hiding the rest)."""
    k, v = (torch.randn(3, 2, 320, 64, generator=torch.Generator().manual_seed(s)).to(DEVICE) for s in (21, 22))
    q = _queries(8, 22, 64, seed=23)
    segments = [(5, 200, 210), (1, 40, 41), (16, 280, 300)]  # rows, first position, kv_len
    alone, masks, table, first = [], [], [], 0
    for i, (rows, start, kv_len) in enumerate(segments):
        mask = _causal(start, rows, kv_len)
        alone.append(da.launch(q[:, first:first + rows].contiguous(), k[i, :, :kv_len], v[i, :, :kv_len], mask,
                               config))
        masks.append(torch.nn.functional.pad(mask, (0, 300 - kv_len), value=False))
        offset = (k[i].data_ptr() - k[0].data_ptr()) // k.element_size()
        table.append([first, rows, offset, offset])
        first += rows
    merged = da.launch(q, k[0, :, :300], v[0, :, :300], torch.cat(masks), config,
                       segments=torch.tensor(table, device=DEVICE), segment_rows=tuple(r for r, _, _ in segments))
    assert torch.equal(merged, torch.cat(alone))
    with pytest.raises(ValueError, match="segments"):
        da.launch(q, k[0, :, :300], v[0, :, :300], None, config, segments=torch.tensor(table, device=DEVICE),
                  segment_rows=(5, 1, 16))
