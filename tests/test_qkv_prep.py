"""The fused q/k/v preparation (flashdraft.layers.qkv_prep): its Triton kernel under Triton's interpreter on the CPU
(compiled on a CUDA machine) against qkv_prep_reference, the torch steps of Attention.forward; strided inputs and
cache views; batch invariance; the argument checks; the custom op under torch.compile."""

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

pytest.importorskip("triton")

from triton_interpreter import interpret_without_gpu  # noqa: E402

from flashdraft.layers import qkv_prep as qp  # noqa: E402
from flashdraft.quant import kv_formats as kf  # noqa: E402
from flashdraft.quant.kv_formats import write_rows  # noqa: E402

interpret_without_gpu("flashdraft.kernels.qkv_prep_triton", qp._kernels)

UNWRITTEN = float("-inf")  # what the caches hold before a call: any row still holding it was not written
CAPACITY = 40


def _inputs(T, heads, kv_heads, hd, dtype, norm, seed):
    """Arguments of qkv_prep except the caches. cos/sin come from arbitrary angles, not a RoPE table whose two halves
    repeat, so mixing up the halves cannot go unnoticed; positions are distinct rows in no particular order; eps is
    large enough to change the normalized values."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * hd, generator=g) * 3
    angles = torch.rand(T, hd, generator=g) * 100
    weights = 1 + 0.3 * torch.randn(2, hd, generator=g)
    return {"qkv": qkv.to(DEVICE, dtype), "cos": angles.cos().to(DEVICE), "sin": angles.sin().to(DEVICE),
            "positions": torch.randperm(CAPACITY, generator=g)[:T].to(DEVICE), "n_heads": heads, "n_kv": kv_heads,
            "q_norm_weight": weights[0].to(DEVICE, dtype) if norm else None,
            "k_norm_weight": weights[1].to(DEVICE, dtype) if norm else None, "eps": 0.5}


def _caches(kv_heads, hd, dtype):
    return tuple(torch.full((kv_heads, CAPACITY, hd), UNWRITTEN, dtype=dtype, device=DEVICE) for _ in range(2))


def _assert_same(out, ref, exact):
    """Bitwise equal, or (not exact: a normalization whose float32 mean of squares sums in another order than
    torch's, see qkv_prep's docstring) a few float32 ulps apart, which bf16 / fp16 rounding hides but rarely."""
    if exact:
        assert torch.equal(out, ref)
    elif out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out, ref)  # about one rounding step of the dtype


NORM_EXACT = not ON_CUDA  # bf16 / fp16 with a norm: bitwise on the CPU; on the GPU torch's mean has its own order


# (dtype, q/k norm, T, head_dim): decode (T = 1) and verify-sized passes, Qwen3 (norm) and Llama (no norm).
CASES = [
    (torch.bfloat16, True, 5, 64),
    (torch.bfloat16, False, 1, 32),
    (torch.float16, True, 2, 32),
    (torch.float32, True, 3, 32),
    (torch.float32, False, 5, 64),
]


@pytest.mark.parametrize("dtype,norm,T,hd", CASES)
def test_matches_the_reference(dtype, norm, T, hd):
    """q and the written cache rows are the eager path's bits (up to a few ulps for float32 with a norm, whose
    mean of squares sums in another order than torch's); no other cache row is touched."""
    args = _inputs(T, 4, 2, hd, dtype, norm, seed=T * hd + norm)
    cache_k, cache_v = _caches(2, hd, dtype)
    ref_k, ref_v = _caches(2, hd, dtype)
    q = qp.qkv_prep(**args, cache_k=cache_k, cache_v=cache_v)
    ref_q = qp.qkv_prep_reference(**args, cache_k=ref_k, cache_v=ref_v)
    assert q.shape == (T, 4, hd) and q.dtype == dtype and q.is_contiguous()
    exact = not norm or (dtype != torch.float32 and NORM_EXACT)
    _assert_same(q, ref_q, exact)
    _assert_same(cache_k, ref_k, exact)
    assert torch.equal(cache_v, ref_v)  # values are copied
    unwritten = torch.ones(CAPACITY, dtype=torch.bool, device=DEVICE)
    unwritten[args["positions"]] = False
    assert (cache_k[:, unwritten] == UNWRITTEN).all() and (cache_v[:, unwritten] == UNWRITTEN).all()
    assert not (cache_k[:, ~unwritten] == UNWRITTEN).any() and not (cache_v[:, ~unwritten] == UNWRITTEN).any()


@pytest.mark.parametrize("norm", [True, False])
def test_keys_and_values_only(norm):
    """No query heads (a drafter's context rows: n_heads = 0): the keys and values written are the eager path's,
    and q is empty."""
    args = _inputs(5, 0, 2, 64, torch.bfloat16, norm, seed=3 + norm)
    args["q_norm_weight"] = args["k_norm_weight"]
    cache_k, cache_v = _caches(2, 64, torch.bfloat16)
    ref_k, ref_v = _caches(2, 64, torch.bfloat16)
    q = qp.qkv_prep(**args, cache_k=cache_k, cache_v=cache_v)
    qp.qkv_prep_reference(**args, cache_k=ref_k, cache_v=ref_v)
    assert q.shape == (5, 0, 64)
    _assert_same(cache_k, ref_k, not norm or NORM_EXACT)
    assert torch.equal(cache_v, ref_v)
    assert not (cache_k[:, args["positions"]] == UNWRITTEN).any()


def test_exact_match_needs_the_eager_roundings():
    """The bitwise comparisons above are not met by just any correct RoPE: rounding once at the end (as a fused
    kernel keeping bf16 intermediates in float32 does) gives other bf16 bits."""
    args = _inputs(5, 4, 2, 64, torch.bfloat16, False, seed=1)
    ref_q = qp.qkv_prep_reference(**args, cache_k=_caches(2, 64, torch.bfloat16)[0],
                                  cache_v=_caches(2, 64, torch.bfloat16)[1])
    x = args["qkv"][:, :4 * 64].unflatten(-1, (4, 64)).float()
    cos, sin = args["cos"].bfloat16().float()[:, None], args["sin"].bfloat16().float()[:, None]
    once = (x * cos + torch.cat([-x[..., 32:], x[..., :32]], dim=-1) * sin).bfloat16()
    assert not torch.equal(once, ref_q)


def test_strided_qkv_and_cache_views():
    """qkv a column slice of a wider product, cos/sin slices of wider tables, the caches views of one layer of a
    bigger cache with rows before and after them: only the views' rows at `positions` change."""
    T, hd, dtype = 5, 32, torch.bfloat16
    args = _inputs(T, 4, 2, hd, dtype, True, seed=11)
    width = args["qkv"].shape[1]
    wide = torch.randn(T, width + 24, device=DEVICE).to(dtype)
    wide[:, 8:8 + width] = args["qkv"]
    args["qkv"] = wide[:, 8:8 + width]
    for name in ("cos", "sin"):
        table = torch.randn(T, 3 * hd, device=DEVICE)
        table[:, hd:2 * hd] = args[name]
        args[name] = table[:, hd:2 * hd]
    big = torch.full((2, 2, 2, CAPACITY + 8, hd), UNWRITTEN, dtype=dtype, device=DEVICE)  # [k/v, layer, kv, rows, hd]
    ref_big = big.clone()
    q = qp.qkv_prep(**args, cache_k=big[0, 1, :, 3:3 + CAPACITY], cache_v=big[1, 1, :, 3:3 + CAPACITY])
    ref_q = qp.qkv_prep_reference(**args, cache_k=ref_big[0, 1, :, 3:3 + CAPACITY],
                                  cache_v=ref_big[1, 1, :, 3:3 + CAPACITY])
    _assert_same(q, ref_q, NORM_EXACT)
    _assert_same(big[0], ref_big[0], NORM_EXACT)
    assert torch.equal(big[1], ref_big[1])
    assert (big[:, 0] == UNWRITTEN).all()  # the other layer
    assert (big[:, 1, :, :3] == UNWRITTEN).all() and (big[:, 1, :, 3 + CAPACITY:] == UNWRITTEN).all()


def test_tokens_are_bitwise_independent_of_the_batch():
    """A token's query and cache rows are the same bits whether it goes alone or as one of 16 tokens."""
    T, hd, dtype = 16, 32, torch.bfloat16
    args = _inputs(T, 2, 1, hd, dtype, True, seed=5)
    cache_k, cache_v = _caches(1, hd, dtype)
    q = qp.qkv_prep(**args, cache_k=cache_k, cache_v=cache_v)
    for t in (0, 9, 15):
        alone = {**args, **{name: args[name][t:t + 1] for name in ("qkv", "cos", "sin", "positions")}}
        alone_k, alone_v = _caches(1, hd, dtype)
        q_alone = qp.qkv_prep(**alone, cache_k=alone_k, cache_v=alone_v)
        row = args["positions"][t]
        assert torch.equal(q_alone[0], q[t])
        assert torch.equal(alone_k[:, row], cache_k[:, row]) and torch.equal(alone_v[:, row], cache_v[:, row])


def test_edge_cases():
    """No tokens: an empty q and untouched caches. A position past the cache: q as usual, no cache row written
    (index_copy_ would raise; the kernel cannot check without a host sync)."""
    args = _inputs(2, 4, 2, 32, torch.bfloat16, True, seed=3)
    cache_k, cache_v = _caches(2, 32, torch.bfloat16)
    empty = {**args, **{name: args[name][:0] for name in ("qkv", "cos", "sin", "positions")}}
    assert qp.qkv_prep(**empty, cache_k=cache_k, cache_v=cache_v).shape == (0, 4, 32)
    args["positions"] = torch.tensor([CAPACITY + 3, -1], device=DEVICE)
    q = qp.qkv_prep(**args, cache_k=cache_k, cache_v=cache_v)
    ref_q = qp.qkv_prep_reference(**{**args, "positions": torch.tensor([0, 1], device=DEVICE)},
                                  cache_k=_caches(2, 32, torch.bfloat16)[0], cache_v=_caches(2, 32, torch.bfloat16)[1])
    _assert_same(q, ref_q, NORM_EXACT)
    assert (cache_k == UNWRITTEN).all() and (cache_v == UNWRITTEN).all()


def test_bad_arguments_are_named():
    args = _inputs(2, 4, 2, 32, torch.bfloat16, True, seed=2)
    cache_k, cache_v = _caches(2, 32, torch.bfloat16)

    def check(match, **changes):
        for fn in (qp.qkv_prep, qp.qkv_prep_reference):
            with pytest.raises(ValueError, match=match):
                fn(**{**args, "cache_k": cache_k, "cache_v": cache_v, **changes})

    check("qkv width", qkv=args["qkv"][:, :-1])
    check("qkv width", n_kv=3)
    check("head_dim 24", qkv=torch.zeros(2, 8 * 24, dtype=torch.bfloat16, device=DEVICE),
          cache_k=cache_k[..., :24], cache_v=cache_v[..., :24], cos=args["cos"][:, :24], sin=args["sin"][:, :24],
          q_norm_weight=None, k_norm_weight=None)
    check("cache shapes", cache_v=cache_v[:, :-1])
    check("cache shapes", cache_k=_caches(1, 32, torch.bfloat16)[0])
    check("cache dtypes", cache_k=cache_k.float(), cache_v=cache_v.float())
    check("unit stride", cache_k=cache_k.transpose(1, 2).contiguous().transpose(1, 2))
    check("cos", cos=args["cos"][:1])
    check("float32", sin=args["sin"].bfloat16())
    check("positions", positions=args["positions"].int())
    check("both q_norm_weight and k_norm_weight", k_norm_weight=None)
    check("q_norm_weight is", q_norm_weight=args["q_norm_weight"].float())
    assert (cache_k == UNWRITTEN).all() and (cache_v == UNWRITTEN).all()


@pytest.mark.parametrize("types", [None, ("q5_0", "q4_1")])
def test_custom_op_and_compile(types):
    """The op's schema declares the cache writes and its fake implementation has q's shape; under torch.compile it
    is one opaque call whose cache writes still land in the caller's tensors. types: caches of block types (uint8
    rows, whose width is symbolic too under dynamic shapes)."""
    args = _inputs(3, 4, 2, 32, torch.bfloat16, True, seed=8)
    cache_k, cache_v = _caches(2, 32, torch.bfloat16) if types is None else _block_caches(2, 32, *types)
    op_args = (args["qkv"], args["cos"], args["sin"], args["positions"], cache_k, cache_v, 4, 2,
               args["q_norm_weight"], args["k_norm_weight"], args["eps"])
    torch.library.opcheck(torch.ops.flashdraft.qkv_prep.default, op_args,
                          test_utils=("test_schema", "test_faketensor"))

    def step(qkv, cos, sin, positions, cache_k, cache_v):
        q = qp.qkv_prep(qkv, cos, sin, positions, cache_k, cache_v, 4, 2, args["q_norm_weight"],
                        args["k_norm_weight"], args["eps"])
        return q.transpose(0, 1) * 2

    # the caches as the decoder holds them, views of one tensor for all layers ([k/v, layer, kv, rows, hd])
    # (block types: both caches' rows as wide as the wider type's, each view as wide as its own)
    marker, width, dtype = ((UNWRITTEN, 32, torch.bfloat16) if types is None else
                            (0xA5, max(kf.kv_format(t).row_width(32) for t in types), torch.uint8))
    big, ref_big = (torch.full((2, 2, 2, CAPACITY, width), marker, dtype=dtype, device=DEVICE) for _ in range(2))
    compiled = torch.compile(step, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (2, 3):  # one graph with a symbolic T (dynamic shapes specialize T = 1)
        tensors = [args[name][:T] for name in ("qkv", "cos", "sin", "positions")]
        views = [[c[i, 1, ..., :(cache_k, cache_v)[i].shape[-1]] for i in range(2)] for c in (big, ref_big)]
        assert torch.equal(compiled(*tensors, *views[0]), step(*tensors, *views[1]))
    assert torch.equal(big, ref_big)
    assert (big[:, 1, :, args["positions"]] != marker).any(-1).all() and (big[:, 0] == marker).all()


def test_one_launch_writes_each_rows_own_sequences_caches():
    """qkv_prep_segments (a batched step's layer): rows of three sequences in one launch, each row's keys and values
    into its own sequence's caches (offsets from the first's), the same bits as each sequence's own qkv_prep."""
    args = _inputs(7, 4, 2, 32, torch.bfloat16, True, seed=31)
    pool = {way: tuple(torch.full((3, 2, CAPACITY, 32), UNWRITTEN, dtype=torch.bfloat16, device=DEVICE)
                       for _ in range(2)) for way in ("alone", "merged")}
    rows, offsets, queries, first = [3, 1, 3], [], [], 0
    fields = ("qkv", "cos", "sin", "positions")
    for i, n in enumerate(rows):
        part = {**args, **{f: args[f][first:first + n] for f in fields}}
        queries.append(qp.qkv_prep(cache_k=pool["alone"][0][i], cache_v=pool["alone"][1][i], **part))
        step = pool["merged"][0][i].data_ptr() - pool["merged"][0][0].data_ptr()
        offsets += [[step // 2, step // 2]] * n
        first += n
    merged = qp.qkv_prep_segments(cache_k=pool["merged"][0][0], cache_v=pool["merged"][1][0],
                                  cache_offsets=torch.tensor(offsets, device=DEVICE), **args)
    assert torch.equal(merged, torch.cat(queries))
    assert torch.equal(pool["merged"][0], pool["alone"][0]) and torch.equal(pool["merged"][1], pool["alone"][1])
    with pytest.raises(ValueError, match="cache_offsets"):
        qp.qkv_prep_segments(cache_k=pool["merged"][0][0], cache_v=pool["merged"][1][0],
                             cache_offsets=torch.tensor(offsets[:-1], device=DEVICE), **args)


@pytest.mark.parametrize("types", [None, ("q5_0", "q4_1")], ids=["float-cache", "block-types"])
def test_values_apart_give_the_concatenated_bits(types):
    """v from its own product (an attn_v of another type than q|k: Q4_K_M files' Q6_K ones): the queries and
    cache rows of qkv_prep over q|k and v concatenated, bit for bit; v as a view into a wider product (its rows
    further apart than its width) and as its own tensor; in one launch over several sequences' caches too. v with
    value_is_key or of the wrong shape is refused by name."""
    T, heads, kv_heads, hd = 5, 4, 2, 32
    args = _inputs(T, heads, kv_heads, hd, torch.bfloat16, True, seed=41)
    qkv = args.pop("qkv")
    qk, v = qkv[:, :(heads + kv_heads) * hd], qkv[:, (heads + kv_heads) * hd:]

    def caches():
        if types is None:
            return _caches(kv_heads, hd, torch.bfloat16)
        return tuple(torch.zeros(kv_heads, CAPACITY, kf.KV_FORMATS[t].row_bytes(hd), dtype=torch.uint8, device=DEVICE)
                     for t in types)

    joined_k, joined_v = caches()
    q = qp.qkv_prep(qkv, cache_k=joined_k, cache_v=joined_v, **args)
    for values in (v, v.contiguous()):
        apart_k, apart_v = caches()
        assert torch.equal(qp.qkv_prep(qk.contiguous(), cache_k=apart_k, cache_v=apart_v, v=values, **args), q)
        assert torch.equal(apart_k, joined_k) and torch.equal(apart_v, joined_v)
    offsets = torch.zeros(T, 2, dtype=torch.int64, device=DEVICE)  # every row into the first caches
    if types is None:
        seg_k, seg_v = caches()
        assert torch.equal(qp.qkv_prep_segments(qk.contiguous(), cache_k=seg_k, cache_v=seg_v, cache_offsets=offsets,
                                                v=v, **args), q)
        assert torch.equal(seg_k, joined_k) and torch.equal(seg_v, joined_v)
    with pytest.raises(ValueError, match="give no v"):
        qp.qkv_prep(qk.contiguous(), cache_k=joined_k, cache_v=joined_v, v=v, value_is_key=True, **args)
    with pytest.raises(ValueError, match="v must be"):
        qp.qkv_prep(qk.contiguous(), cache_k=joined_k, cache_v=joined_v, v=v[:, :-1], **args)
    with pytest.raises(ValueError, match="qkv width"):  # q|k|v with a v beside it: one value head set too many
        qp.qkv_prep(qkv, cache_k=joined_k, cache_v=joined_v, v=v, **args)


def test_gemma_values_apart_take_their_own_norm():
    """Gemma 4's sliding layers with a v of another type than q|k: v read apart gets the concatenated row's bits,
    its RMS norm from its own mean of squares (the key's would change them), in a ring."""
    T, hd = 3, 64
    args = _inputs(T, 4, 2, hd, torch.bfloat16, True, seed=43)
    args["positions"] = args["positions"] + 2 * CAPACITY
    qkv = args.pop("qkv")
    joined_k, joined_v = _caches(2, hd, torch.bfloat16)
    q = qp.qkv_prep(qkv, cache_k=joined_k, cache_v=joined_v, gemma=True, wrap=True, **args)
    apart_k, apart_v = _caches(2, hd, torch.bfloat16)
    q_apart = qp.qkv_prep(qkv[:, :6 * hd].contiguous(), cache_k=apart_k, cache_v=apart_v, gemma=True, wrap=True,
                          v=qkv[:, 6 * hd:], **args)
    assert torch.equal(q_apart, q) and torch.equal(apart_k, joined_k) and torch.equal(apart_v, joined_v)
    assert not (apart_v == UNWRITTEN).all()


def _gemma_module_path(qkv, cos, sin, positions, cache_k, cache_v, n_heads, n_kv, q_norm_weight, k_norm_weight,
                       eps, value_is_key, wrap):
    """What Gemma4Attention.forward does before attention when it does not take qkv_prep: Gemma4RMSNorm on the
    query and key heads (and, without a weight, on the values), apply_rope, write_rows at position % ring on a
    sliding layer."""
    from flashdraft.models.gemma4.model import Gemma4RMSNorm, apply_rope

    hd = cos.shape[1]
    T = qkv.shape[0]
    norms = [Gemma4RMSNorm(hd, eps).to(DEVICE) for _ in range(2)]
    for norm, weight in zip(norms, (q_norm_weight, k_norm_weight)):
        norm.weight = torch.nn.Parameter(weight, requires_grad=False)
    parts = qkv.split([n_heads * hd, n_kv * hd] + [n_kv * hd] * (not value_is_key), dim=-1)
    raw_k = parts[1].view(T, n_kv, hd)
    v = Gemma4RMSNorm(hd, eps, with_weight=False)(raw_k if value_is_key else parts[2].view(T, n_kv, hd))
    rows = positions % cache_k.shape[1] if wrap else positions
    write_rows(cache_k, rows, apply_rope(norms[1](raw_k), cos, sin).transpose(0, 1))
    write_rows(cache_v, rows, v.transpose(0, 1))
    return apply_rope(norms[0](parts[0].view(T, n_heads, hd)), cos, sin)


def _mostly_same_bits(out, ref):
    """Close, and bitwise equal but for rare last-place differences: the kernel's rsqrt and its order of the mean
    of squares against torch's pow(..., -0.5) and reduction. Rounding at another step (the weight product after
    a rounding, as Qwen3's norm does) changes far more elements."""
    torch.testing.assert_close(out, ref)
    assert (out != ref).float().mean().item() < 0.01


# (T, head_dim, value_is_key, wrap): Gemma 4's sliding layers (their own value heads, a ring) and full layers
# (values from the keys, rows at their positions), 512-wide heads included
GEMMA_CASES = [(3, 32, False, True), (2, 64, True, False), (1, 512, True, False), (2, 256, False, True)]


@pytest.mark.parametrize("T,hd,value_is_key,wrap", GEMMA_CASES)
def test_gemma_matches_the_module_path(T, hd, value_is_key, wrap):
    """gemma=True: queries and cache rows as Gemma4Attention's module path gives them; value_is_key reads no value
    heads; wrap writes position % capacity (positions past the ring here); no other cache row is touched."""
    args = _inputs(T, 4, 2, hd, torch.bfloat16, True, seed=T * hd + wrap)
    if value_is_key:
        args["qkv"] = args["qkv"][:, :6 * hd].contiguous()
    if wrap:
        args["positions"] = args["positions"] + 2 * CAPACITY
    cache_k, cache_v = _caches(2, hd, torch.bfloat16)
    ref_k, ref_v = _caches(2, hd, torch.bfloat16)
    q = qp.qkv_prep(**args, cache_k=cache_k, cache_v=cache_v, gemma=True, value_is_key=value_is_key, wrap=wrap)
    ref_q = _gemma_module_path(**args, cache_k=ref_k, cache_v=ref_v, value_is_key=value_is_key, wrap=wrap)
    assert q.shape == (T, 4, hd)
    for out, ref in ((q, ref_q), (cache_k, ref_k), (cache_v, ref_v)):
        _mostly_same_bits(out, ref)
    written = args["positions"] % CAPACITY
    assert not (cache_k[:, written] == UNWRITTEN).any() and (cache_k == UNWRITTEN).sum() == 2 * (CAPACITY - T) * hd
    if not value_is_key:  # the values are normalized, not copied
        assert not torch.equal(cache_v[:, written], args["qkv"][:, 6 * hd:].unflatten(-1, (2, hd)).transpose(0, 1))
    with pytest.raises(ValueError, match="qkv width"):
        qp.qkv_prep(**{**args, "qkv": args["qkv"][:, :-1]}, cache_k=cache_k, cache_v=cache_v, gemma=True,
                    value_is_key=value_is_key, wrap=wrap)
    with pytest.raises(ValueError, match="gemma=True needs"):
        qp.qkv_prep(**{**args, "q_norm_weight": None, "k_norm_weight": None}, cache_k=cache_k, cache_v=cache_v,
                    gemma=True, value_is_key=value_is_key, wrap=wrap)


def _block_caches(kv_heads, hd, k_type, v_type):
    """Caches of block types whose every byte starts at 0xA5, so a row written can be told from one left alone."""
    return tuple(kf.new_rows(kf.kv_format(name), kv_heads, CAPACITY, hd, DEVICE).fill_(0xA5)
                 for name in (k_type, v_type))


def _awkward_values(args, hd, n_heads, kv_heads):
    """Value heads (stored as given: no norm on Qwen3's values) with the blocks that test a quantizer's edges:
    all zeros, a tie between +x and -x for the largest magnitude (the first decides d's sign), one value far
    above the rest, and negative zeros."""
    v = args["qkv"][:, (n_heads + kv_heads) * hd:].unflatten(-1, (kv_heads, hd // 32, 32))
    v[0, 0, 0] = 0.0
    v[0, 1, 0] = -0.0
    v[1, 0, 0] = 0.5
    v[1, 0, 0, 3], v[1, 0, 0, 9] = -2.5, 2.5
    v[-1, -1, -1, 7] = 40.0


# (K type, V type, head_dim): every block type for keys and values, the walkthrough's q5_0 / q4_1 pair
BLOCK_CASES = [("q8_0", "q4_0", 64), ("q4_1", "q5_0", 32), ("q5_1", "q8_0", 128), ("q5_0", "q4_1", 64)]


@pytest.mark.parametrize("k_type,v_type,hd", BLOCK_CASES)
def test_block_type_rows_are_the_quantized_reference(k_type, v_type, hd):
    """Caches of llama.cpp's block types: the kernel quantizes each row it writes, and the bytes are those of
    kv_formats.quantize on the reference path's rows (blocks of zeros, ties and outliers included); no other
    row's bytes change."""
    T = 5
    args = _inputs(T, 4, 2, hd, torch.bfloat16, True, seed=hd + len(k_type))
    _awkward_values(args, hd, 4, 2)
    cache_k, cache_v = _block_caches(2, hd, k_type, v_type)
    ref_k, ref_v = _block_caches(2, hd, k_type, v_type)
    q = qp.qkv_prep(**args, cache_k=cache_k, cache_v=cache_v)
    ref_q = qp.qkv_prep_reference(**args, cache_k=ref_k, cache_v=ref_v)
    _assert_same(q, ref_q, NORM_EXACT)
    assert torch.equal(cache_v, ref_v)  # the values go in unchanged: their bytes are exact on any device
    if NORM_EXACT:
        assert torch.equal(cache_k, ref_k)
    else:  # a key an ulp apart may land in another quantization step
        assert (cache_k != ref_k).float().mean().item() < 0.01
    untouched = torch.ones(CAPACITY, dtype=torch.bool, device=DEVICE)
    untouched[args["positions"]] = False
    assert (cache_k[:, untouched] == 0xA5).all() and (cache_v[:, untouched] == 0xA5).all()


def test_block_type_rows_of_gemma():
    """Gemma 4's steps into caches of the walkthrough's types (-ctk q5_0 -ctv q4_1) on a sliding layer's ring:
    the bytes of the module path's rows, quantized."""
    T, hd = 3, 64
    args = _inputs(T, 4, 2, hd, torch.bfloat16, True, seed=77)
    args["positions"] = args["positions"] + CAPACITY
    cache_k, cache_v = _block_caches(2, hd, "q5_0", "q4_1")
    ref_k, ref_v = _block_caches(2, hd, "q5_0", "q4_1")
    q = qp.qkv_prep(**args, cache_k=cache_k, cache_v=cache_v, gemma=True, wrap=True)
    ref_q = _gemma_module_path(**args, cache_k=ref_k, cache_v=ref_v, value_is_key=False, wrap=True)
    _mostly_same_bits(q, ref_q)
    assert (cache_k != ref_k).float().mean().item() < 0.01 and (cache_v != ref_v).float().mean().item() < 0.01
    written = args["positions"] % CAPACITY
    assert not (cache_k[:, written] == 0xA5).all() and (cache_k == 0xA5).sum() > 0
