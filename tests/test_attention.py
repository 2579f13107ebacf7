"""grouped_attention: grouped query heads under a mask, folded into one multi-head call (no math fallback)."""
import pytest
import torch
import torch.nn.functional as F

from flashdraft.layers.attention import grouped_attention


@pytest.mark.parametrize("b,heads,kv_heads,Tq,Tk,layout", [
    (2, 6, 2, 5, 9, "b1qk"), (1, 8, 2, 4, 7, "qk"), (3, 4, 1, 1, 6, "b1qk"), (2, 6, 3, 5, 9, "bqk"),
    (2, 4, 4, 3, 5, "b1qk")])
def test_matches_sdpa_with_repeated_kv_heads(b, heads, kv_heads, Tq, Tk, layout):
    g = torch.Generator().manual_seed(Tq * 31 + heads)
    q = torch.randn(b, heads, Tq, 16, generator=g)
    k, v = torch.randn(2, b, kv_heads, Tk, 16, generator=g)
    allowed = torch.rand(b, Tq, Tk, generator=g) > 0.4
    allowed[..., 0] = True  # every query row sees one key
    mask = {"b1qk": allowed[:, None], "bqk": allowed, "qk": allowed[0]}[layout]
    group = heads // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         attn_mask=mask[:, None] if layout == "bqk" else mask)
    torch.testing.assert_close(grouped_attention(q, k, v, mask), ref, rtol=1e-5, atol=1e-6)


def test_per_head_masks_are_refused():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="shared by the heads"):
        grouped_attention(q, k, k, torch.ones(1, 4, 2, 3, dtype=torch.bool))


@pytest.mark.parametrize("heads,kv_heads,Tq,Tk", [(4, 2, 5, 9), (6, 3, 7, 7), (4, 4, 3, 8)])
def test_lower_right_causal_bias_matches_its_boolean_mask(heads, kv_heads, Tq, Tk):
    """A causal bias from the lower right (an eager prefill pass over a cache) attends as the boolean mask of the
    same shape: query t sees keys up to Tk - Tq + t."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(Tq + Tk)
    q = torch.randn(1, heads, Tq, 16, generator=g)
    k, v = torch.randn(2, 1, kv_heads, Tk, 16, generator=g)
    mask = torch.arange(Tk)[None, :] <= torch.arange(Tk - Tq, Tk)[:, None]
    torch.testing.assert_close(grouped_attention(q, k, v, causal_lower_right(Tq, Tk)),
                               grouped_attention(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_scale_is_passed_through():
    """Gemma 4 attends with scale 1.0 (its q/k norms): folded or not, grouped_attention applies the given scale."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 9, 16, generator=g)
    mask = torch.rand(5, 9, generator=g) > 0.3
    mask[:, 0] = True
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask,
                                         scale=1.0)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, scale=1.0), ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(grouped_attention(q, k, v, mask), ref, atol=1e-3)


def test_a_causal_bias_with_grouped_heads_is_folded_where_flash_cannot_take_it(monkeypatch):
    """Off the flash kernel (here: the CPU), SDPA would meet a causal bias with grouped heads by building its mask
    and running the math kernel with the key/value heads repeated; grouped_attention builds the boolean mask itself
    and folds the groups into the query length, as for any mask: one call, no enable_gqa."""
    from torch.nn.attention.bias import causal_lower_right

    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape, kwargs.get("enable_gqa", False), type(kwargs.get("attn_mask")).__name__))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 9, 16)
    grouped_attention(q, k, k, causal_lower_right(5, 9))
    assert calls == [(torch.Size([1, 2, 10, 16]), False, "Tensor")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's flash kernel runs on CUDA")
@pytest.mark.parametrize("Tq,Tk", [(512, 512), (512, 4096), (100, 3000)])
def test_lower_right_causal_passes_over_a_cache_run_the_flash_kernel(Tq, Tk):
    """A prefill pass over a cache (fewer queries than keys) with grouped heads runs SDPA's flash kernel, no mask
    tensor: the question put to can_use_flash_attention once asked for upper-left causal attention, which flash
    refuses when the lengths differ, and every such pass took the masked kernel at a quarter of the speed."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(Tq)
    q = torch.randn(1, 32, Tq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = torch.randn(2, 1, 8, Tk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = grouped_attention(q, k, v, causal_lower_right(Tq, Tk))
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert any("flash" in name.lower() for name in kernels), kernels
    mask = torch.arange(Tk, device="cuda")[None, :] <= torch.arange(Tk - Tq, Tk, device="cuda")[:, None]
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1),
                                         v.float().repeat_interleave(4, 1), attn_mask=mask)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("flash", [False, True])
def test_compiled_with_dynamic_shapes_a_causal_bias_breaks_no_graph(monkeypatch, flash):
    """The compiled layers (dynamic shapes) trace grouped_attention whole: on the flash branch (CUDA; taken here on
    the CPU by answering can_use_flash_attention's question with yes) SDPA once got enable_gqa as a symbolic bool,
    which it refuses, and dynamo broke every layer's graph there (seen on the H200, docs/performance.md)."""
    import flashdraft.layers.attention as attention
    from torch._dynamo.utils import counters
    from torch.nn.attention.bias import causal_lower_right

    monkeypatch.setattr(attention, "can_use_flash_attention", lambda params: flash)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v, bias: attention.grouped_attention(q, k, v, bias) * 2, dynamic=True)
    for T in (24, 40):
        q, k, v = torch.randn(1, 4, T, 16), torch.randn(1, 2, T, 16), torch.randn(1, 2, T, 16)
        bias = causal_lower_right(T, T)
        torch.testing.assert_close(compiled(q, k, v, bias), 2 * attention.grouped_attention(q, k, v, bias))
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
