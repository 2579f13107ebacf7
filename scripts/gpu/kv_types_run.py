"""KV cache types on the GPU (issue #20): the compiled kernels that read packed caches, checked and timed.

1. The demo pair in bf16 with each cache type (target and drafter alike): greedy DFlash == plain decoding,
   tau, and tokens before the first divergence from the bf16 cache's output, on file starts of 1-3K tokens
   (docs/demo/heldout_code.jsonl, kind "long") and the bench's code prompts.
2. The synthetic Qwen3-8B shape (bf16 weights, the engine's CUDA default path): plain decoding after a
   prompt of CONTEXT random tokens, per cache type: tok/s, cache bytes per token, and the step's roofline
   (weights + the cache read once per token).

    PYTHONPATH=src python scripts/gpu/kv_types_run.py OUT_DIR [--context 32768] [--tokens 128]
"""
import argparse
import json
import time
from pathlib import Path

import torch

from flashdraft.bench.prompts import load_prompt_set
from flashdraft.bench.synthetic import build_synthetic, measure_bandwidth, weight_bytes
from flashdraft.config import SamplingParams
from flashdraft.demo import demo_paths
from flashdraft.engine.generator import Engine

TYPES = [("bf16", "bf16"), ("q8_0", "q8_0"), ("q5_0", "q4_1"), ("q4_0", "q4_0")]
START = time.monotonic()
DEADLINE_S = 480.0


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def kernel_reads_check(log) -> list[dict]:
    """decode_attention over packed rows against decode_attention over their dequantized values (bf16), per type:
    the compiled kernel must dequantize as kv_formats does (equal, or within float32 contraction of d * q + m)."""
    from flashdraft.layers import decode_attention as da
    from flashdraft.quant import kv_formats as kf
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(32, 4, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(8, 3000, 128, device="cuda", generator=g) * 2
    v = torch.randn(8, 3000, 128, device="cuda", generator=g)
    mask = torch.ones(4, 3000, dtype=torch.bool, device="cuda")
    results = []
    for name in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0"):
        fmt = kf.kv_format(name)
        pk, pv = kf.quantize(k, fmt), kf.quantize(v, fmt)
        dk, dv = kf.dequantize_rows(pk, fmt, torch.bfloat16), kf.dequantize_rows(pv, fmt, torch.bfloat16)
        packed, plain = da.launch(q, pk, pv, mask), da.launch(q, dk, dv, mask)
        diff = (packed.float() - plain.float()).abs().max().item()
        results.append({"type": name, "equal": torch.equal(packed, plain), "max_abs_diff": diff})
        log(f"kernel over packed {name} rows vs over their dequantized rows: equal {torch.equal(packed, plain)}, "
            f"max |diff| {diff:.3g}")
    return results


def demo_pair_check(log) -> list[dict]:
    target_dir, drafter_dir = demo_paths()
    repo = Path(__file__).resolve().parents[2]
    rows = [json.loads(line) for line in (repo / "docs/demo/heldout_code.jsonl").read_text().splitlines()]
    prompts = [("long", r["prompt"], None) for r in rows if r["kind"] == "long"][:6]
    prompts += [("code", None, p.messages) for p in load_prompt_set("code")]
    params = SamplingParams(max_tokens=128)
    results, reference = [], {}
    for k_type, v_type in TYPES:
        if time.monotonic() - START > DEADLINE_S:
            log(f"demo pair {k_type}/{v_type}: skipped, past the run's {DEADLINE_S} s")
            continue
        engine = Engine.load(target_dir, drafter_dir, device="cuda", context_size=4096, cache_type_k=k_type,
                             cache_type_v=v_type, draft_cache_type_k=k_type, draft_cache_type_v=v_type)
        same = accepted = steps = agreed = total = 0
        for i, (kind, text, messages) in enumerate(prompts):
            ids = engine.encode_prompt(text, messages)
            plain = engine.generate(ids, params, 0)
            dflash = engine.generate(ids, params, engine.max_draft)
            same += dflash.tokens == plain.tokens
            accepted, steps = accepted + dflash.stats.draft_n_accepted, steps + dflash.stats.steps
            reference.setdefault(i, plain.tokens)
            agreed += first_divergence(reference[i], plain.tokens)
            total += len(reference[i])
        row = {"k": k_type, "v": v_type, "prompts": len(prompts), "dflash_equals_plain": same,
               "tau": (accepted + steps) / steps, "tokens_agreeing_with_bf16": agreed, "tokens": total}
        results.append(row)
        log(f"demo pair {k_type}/{v_type}: DFlash == plain on {same}/{len(prompts)}, tau {row['tau']:.2f}, "
            f"{agreed}/{total} tokens before the first divergence from the bf16 cache")
        del engine
        torch.cuda.empty_cache()
    return results


def long_context_speed(context: int, tokens: int, log) -> list[dict]:
    dev = torch.device("cuda")
    target, _ = build_synthetic("qwen3-8b", dev, torch.bfloat16, context + tokens + 64)
    weights_gb = weight_bytes(target, ("model.embed_tokens",)) / 1e9
    bandwidth = measure_bandwidth(dev)
    log(f"qwen3-8b synthetic: {weights_gb:.2f} GB of weights a step, copy bandwidth {bandwidth:.0f} GB/s")
    prompt = torch.randint(10, target.config.vocab_size - 10, (context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    results, reference = [], None
    for k_type, v_type in TYPES:
        if time.monotonic() - START > DEADLINE_S:
            log(f"  {k_type}/{v_type}: skipped, past the run's {DEADLINE_S} s")
            continue
        engine = Engine(target, None, None, context_size=context + tokens + 64, cache_type_k=k_type,
                        cache_type_v=v_type)
        engine.generate(prompt[:256], SamplingParams(max_tokens=16, ignore_eos=True), 0)  # warm-up, captures
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompt, params, 0)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        s = out.stats
        tok_s = (s.predicted_n - 1) / (s.predicted_ms / 1000)
        seq = engine.decoder.new_sequence()
        per_token = seq.target_cache.bytes_per_token()
        kv_gb = per_token * (context + tokens / 2) / 1e9
        roofline = bandwidth / (weights_gb + kv_gb)
        reference = reference or out.tokens
        row = {"k": k_type, "v": v_type, "context": context, "decode_tok_s": tok_s, "prompt_ms": s.prompt_ms,
               "bytes_per_token": per_token, "kv_gb": kv_gb, "roofline_tok_s": roofline,
               "percent_of_roofline": 100 * tok_s / roofline, "wall_s": wall,
               "tokens_agreeing_with_bf16": first_divergence(reference, out.tokens),
               "peak_gb": torch.cuda.max_memory_allocated() / 1e9}
        results.append(row)
        log(f"  {k_type}/{v_type}: {tok_s:7.1f} tok/s at {context} tokens ({row['percent_of_roofline']:.0f}% of "
            f"{roofline:.0f} with {kv_gb:.2f} GB of cache read), prefill {s.prompt_ms:.0f} ms, "
            f"{per_token} B/token, {row['tokens_agreeing_with_bf16']}/{tokens} tokens as bf16's")
        del engine, seq
        torch.cuda.empty_cache()
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--deadline", type=float, default=480, help="seconds after which no new case starts")
    args = p.parse_args()
    global DEADLINE_S
    DEADLINE_S = args.deadline
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "kv_types.log").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    log(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    report = {"kernel_reads": kernel_reads_check(log), "demo_pair": demo_pair_check(log)}
    (args.out / "kv_types.json").write_text(json.dumps(report, indent=1))
    report["long_context"] = long_context_speed(args.context, args.tokens, log)
    (args.out / "kv_types.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
