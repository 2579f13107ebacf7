"""Is a Gemma 4 target pass batch-invariant? The question lossless greedy DFlash rests on: does a token's logit
row come out bitwise the same when the token is verified inside a 16-token block as when it is decoded alone?

Builds a Gemma-4-31B-wide target (hidden 5376, real head shapes, random Q4_K/Q5_K projections and Q6_K tied
embedding, as scripts/gpu/gguf_run.py) with 6 layers (5 sliding, 1 full) and ordinary norm weights, prefills 100
random tokens, then for each way of running the layers (eager with SDPA; the engine's CUDA settings, with
decode_attention, uncompiled and compiled) compares the logits and the last hidden state of a 16-token pass
with 16 one-token passes at the same positions and attention length (as the engine's graphs use: the length
rounded up to 256). Also the parts alone: Gemma4RMSNorm rows, SDPA rows (sliding mask and full), eager and
compiled.

--moe: a Gemma-4-26B-A4B-wide target instead (hidden 2816, 128 experts of 704, top-8, the shared MLP of 2112; 6
layers, 5 sliding and 1 full), all weights bf16 and random: beside the joins the dense layers have, an MoE layer
has a router (top-k, the weights' sum), the experts' weighted sum and four more norms, so whether a compiled MoE
layer rounds a token alike alone and in a block is its own question (on an H100, 2026-12-07, with those norms
compiled: 7 of 16 rows differed; now each is one row kernel, rms_norm_rows.gemma_norm / gemma_add).

Usage (repo root): PYTHONPATH=src python scripts/gpu/gemma4_invariance.py OUT_DIR [--tiny] [--moe]
Writes OUT_DIR/gemma4_invariance.json (--moe: gemma4_moe_invariance.json, with the compiled MoE layer's pieces
one by one: moe_parts_check). --tiny: small shapes on the CPU (for a syntax check, not for findings).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

import gguf_run  # noqa: E402


def rows_report(block: torch.Tensor, singles: list[torch.Tensor]) -> dict:
    """block [T, ...] against T single-row results: how many rows differ at all, and the largest difference."""
    unequal = sum(int(not torch.equal(block[i], s.reshape(block[i].shape))) for i, s in enumerate(singles))
    diff = max(float((block[i].float() - s.reshape(block[i].shape).float()).abs().max()) for i, s in enumerate(singles))
    return {"rows": len(singles), "rows_unequal": unequal, "max_abs_diff": diff}


def model_check(target, dev, prompt_len: int, T: int, gen) -> dict:
    from flashdraft.engine.cuda_graphs import bucket

    vocab = target.config.vocab_size
    cache = target.new_cache(prompt_len + T + 64)
    prompt = torch.randint(0, vocab, (prompt_len,), device=dev, generator=gen)
    block = torch.randint(0, vocab, (T,), device=dev, generator=gen)
    kv = bucket(prompt_len + T, cache.capacity)
    taps = [len(target.model.layers) - 1]
    target(prompt, torch.arange(prompt_len, device=dev), cache, prompt_len)
    logits16, h16 = target(block, torch.arange(prompt_len, prompt_len + T, device=dev), cache, kv, tap_ids=taps)
    singles, hs = [], []
    for i in range(T):
        logits, h = target(block[i:i + 1], torch.tensor([prompt_len + i], device=dev), cache, kv, tap_ids=taps)
        singles.append(logits)
        hs.append(h)
    return {"logits": rows_report(logits16, singles), "hidden": rows_report(h16, hs)}


def parts_check(target, dev, compiled: bool, gen, dtype) -> dict:
    """RMSNorm and SDPA alone, the same rows inside a 16-row call and alone."""
    import torch.nn.functional as F

    from flashdraft.models.gemma4.model import Gemma4RMSNorm

    H = target.config.hidden_size
    out = {}
    norm = Gemma4RMSNorm(H).to(dev)
    norm.weight.data.normal_(1.0, 0.1, generator=gen)
    fn = torch.compile(norm, dynamic=True) if compiled else norm
    x = torch.randn(16, H, device=dev, generator=gen).to(dtype)
    out["rms_norm"] = rows_report(fn(x), [fn(x[i:i + 1]) for i in range(16)])

    def sdpa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)

    sd = torch.compile(sdpa, dynamic=True) if compiled else sdpa
    cfg = target.config
    full_layer = cfg.layer_types.index(gguf_run.FULL)
    for kind, layer in (("sliding", 0), ("full", full_layer)):
        heads, kv_heads, hd = cfg.num_attention_heads, cfg.layer_kv_heads[layer], cfg.layer_head_dims[layer]
        L = 512
        q = torch.randn(1, heads, 16, hd, device=dev, generator=gen).to(dtype)
        k = torch.randn(1, kv_heads, L, hd, device=dev, generator=gen).to(dtype) / hd ** 0.5
        v = torch.randn(1, kv_heads, L, hd, device=dev, generator=gen).to(dtype)
        pos = torch.arange(400, 416, device=dev)
        mask = torch.arange(L, device=dev)[None, :] <= pos[:, None]
        full = sd(q, k, v, mask[None, None])[0].transpose(0, 1)
        alone = [sd(q[:, :, i:i + 1], k, v, mask[None, None, i:i + 1])[0].transpose(0, 1) for i in range(16)]
        out[f"sdpa_{kind}"] = rows_report(full, alone)
    return out


def moe_parts_check(target, dev, gen, dtype) -> dict:
    """Layer 0's MoE pieces, each compiled on its own as the engine compiles a layer (dynamic shapes): a row of a
    16-row call against the row alone, to find which piece of a compiled MoE layer parts a token's rows. Also how
    many of the 16 rows have tied router scores among their top k + 1 (bf16 scores tie often; a top-k whose order
    among ties followed the pass's shape would part rows)."""
    from flashdraft.layers.rms_norm_rows import gemma_add_norm, gemma_add_scaled_norm

    layer = target.model.layers[0]
    H = target.config.hidden_size
    h, attn, ff = (torch.randn(16, H, device=dev, generator=gen).to(dtype) for _ in range(3))
    weights, experts = layer.router(h)
    x = layer.pre_feedforward_layernorm_2(h)

    def post(attn, h):  # the layer after its attention, its forward's few-row path
        h, x = gemma_add_norm(attn, h, layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight,
                              layer.post_attention_layernorm.eps)
        ff = layer._with_experts(h, layer.mlp(x))
        post_ff, next_norm = layer.post_feedforward_layernorm, target.model.layers[1].input_layernorm
        return gemma_add_scaled_norm(ff, h, post_ff.weight, layer.layer_scalar, next_norm.weight, post_ff.eps)

    pieces = {"router": (lambda h: layer.router(h), (h,)),
              "experts": (lambda x, w, e: layer.experts(x, w, e), (x, weights, experts)),
              "mlp": (lambda x: layer.mlp(x), (h,)),
              "moe_branch": (lambda h, ff: layer._with_experts(h, ff), (h, ff)),
              "post_attention": (post, (attn, h))}
    out = {}
    for name, (fn, args) in pieces.items():
        torch._dynamo.reset()
        fn = torch.compile(fn, dynamic=True)
        block = fn(*args)
        alone = [fn(*(a[i:i + 1] for a in args)) for i in range(16)]
        block, alone = (block, [(a,) for a in alone]) if isinstance(block, torch.Tensor) else (block, alone)
        block = block if isinstance(block, tuple) else (block,)
        out[name] = [rows_report(b, [a[j] for a in alone]) for j, b in enumerate(block)]
    r = layer.router
    scores = r.proj(r.norm(h) * r.scale * r.root_size).float()
    top = scores.topk(r.top_k + 1, dim=-1).values
    out["rows_with_tied_top_scores"] = int((top[:, 1:] == top[:, :-1]).any(-1).sum())
    return out


MOE_26B = dict(gguf_run.GEMMA4_31B, hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
               num_key_value_heads=8, num_global_key_value_heads=2, enable_moe_block=True, num_experts=128,
               top_k_experts=8, moe_intermediate_size=704)
MOE_TINY = dict(gguf_run.GEMMA4_TINY, enable_moe_block=True, num_experts=16, top_k_experts=8,
                moe_intermediate_size=64)


def build_moe_target(dev, dtype, gen, attention: str, compiled: bool, tiny: bool, layer_types: list[str]):
    """The 26B-A4B-wide target (MOE_26B, or MOE_TINY), weights N(0, 0.02) in `dtype` and norms of 1, with the plan
    the engine resolves for the device and these backends."""
    from flashdraft.engine.model_prep import resolve_plan
    from flashdraft.models.gemma4.config import Gemma4Config
    from flashdraft.models.gemma4.model import Gemma4LM

    raw = dict(MOE_TINY if tiny else MOE_26B, num_hidden_layers=len(layer_types), layer_types=layer_types)
    cfg = Gemma4Config.from_dict(raw, "gemma-4-26b-a4b (synthetic)")
    with torch.device("meta"):
        target = Gemma4LM(cfg, resolve_plan(dev, None, attention, compiled, 16))
    gguf_run.materialize(target, dev, dtype, gen, {"norm.weight": 1.0, "layer_scalar": 1.0, "router.scale": 1.0,
                                                    "per_expert_scale": 1.0})
    if cfg.tie_word_embeddings:  # materialize gave the LM head a weight of its own
        target.lm_head.weight = target.model.embed_tokens.weight
    for kind in sorted(set(cfg.layer_types)):
        name = f"{kind}_inv_freq"
        setattr(target, name, getattr(target, name).to(dev))
    target.prepare()
    return target.eval().requires_grad_(False)


def ordinary_norms(target, gen) -> None:
    """The layers' and the final norm's weights N(1, 0.1): ordinary norms, not gguf_run's embedding-dominated
    residual or build_moe_target's ones."""
    for name, p in target.named_parameters():
        if ("layernorm" in name and name.endswith(".weight")) or name == "model.norm.weight":
            p.data.normal_(1.0, 0.1, generator=gen)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--moe", action="store_true")
    args = ap.parse_args(argv)
    if args.tiny or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are imported
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    base = gguf_run.GEMMA4_TINY if dev.type == "cpu" else gguf_run.GEMMA4_31B
    layers = 6
    layer_types = [gguf_run.FULL if (i + 1) % 6 == 0 else gguf_run.SLIDING for i in range(layers)]
    gguf_run.GEMMA4_31B = gguf_run.GEMMA4_TINY = dict(base, num_hidden_layers=layers, layer_types=layer_types)
    run = gguf_run.Run(args.out, 600.0, dev.type == "cpu")
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variants": {}}
    from flashdraft.engine.model_prep import compile_layers

    # eager SDPA (as before decode_attention took Gemma 4); the engine's CUDA settings without and with compiled
    # layers (the projections are quantized, so their kernels are the engine's already). Each over a target built
    # with its plan, the same weights.
    variants = [("eager_sdpa", "sdpa", False), ("engine_eager", "triton", False), ("engine", "triton", True)]
    for name, attention, compiled in variants:
        t = time.time()
        torch._dynamo.reset()
        gen = torch.Generator(device=dev).manual_seed(0)
        target = None  # the last variant's, freed before the next is built
        if args.moe:
            target = build_moe_target(dev, dtype, gen, attention, compiled, dev.type == "cpu", layer_types)
        else:
            target, _, _ = gguf_run.build_models(run, dev, dtype, gen, 256, drafter_bf16=True, attention=attention,
                                                 compile=compiled)
        ordinary_norms(target, gen)
        if compiled:
            compile_layers(target)
        try:
            with torch.inference_mode():
                rec = model_check(target, dev, 100, 16, gen)
                if name != "engine_eager":
                    rec.update(parts_check(target, dev, compiled, gen, dtype))
                if args.moe and compiled:
                    rec["moe_parts"] = moe_parts_check(target, dev, gen, dtype)
        except Exception as e:  # noqa: BLE001
            rec = {"error": f"{type(e).__name__}: {e}"[:2000]}
        rec["seconds"] = round(time.time() - t, 1)
        result["variants"][name] = rec
        print(name, json.dumps(rec), flush=True)
        (args.out / ("gemma4_moe_invariance.json" if args.moe else "gemma4_invariance.json")).write_text(
            json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
