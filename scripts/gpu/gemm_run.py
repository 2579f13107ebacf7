"""The batch-invariant skinny GEMM (flashdraft.layers.skinny_gemm) against cuBLAS on one GPU, then the synthetic
benchmark with each backend.

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/gemm_run.py OUT_DIR [--sweep] [--no-bench]
  --sweep     time a wider set of tilings per shape (slower; for choosing skinny_gemm.CONFIGS)
  --no-bench  skip the synthetic benchmark stage; --no-gemm: skip the GEMM stage

Stages (each one's exception is caught and reported, so one failure does not lose the rest):
  1. bandwidth: read (sum of a 2 GiB tensor) and copy (2 GiB device-to-device) in GB/s
  2. per weight shape of Qwen3-8B and its DFlash drafter: correctness against an fp32 product, bitwise batch
     invariance (rows of M = 16 == the same rows at M = 1..15) for the Triton kernel and, for information, cuBLAS;
     then time per call of cuBLAS (F.linear) and each Triton tiling at M = 1, 2, 4, 8, 16: a CUDA graph of many
     calls rotating over weight copies (> 3x the 60 MB L2 in all, so L2 does not help), replayed under
     triton.testing.do_bench (median); GB/s and % of the measured read bandwidth
  3. a whole target pass (random Qwen3 1B shape, eager): logits of a 16-token verify vs 16 single-token steps,
     rows bitwise equal, with each GEMM backend
  4. flashdraft.bench.synthetic.run at the qwen3-8b shape, variants graphs+compiled (cuBLAS) and
     graphs+compiled+triton: baseline tok/s, % of roofline, step times, DFlash speedups at tau 2/4/6/8/16
Writes OUT_DIR/gemm.json (after every stage) and prints a compact table last.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from flashdraft.layers import skinny_gemm as sg

# name -> (N, K): Qwen3-8B's fused projections and LM head; the drafter (z-lab's Qwen3-8B-DFlash-b16) has the
# same layer shapes plus fc over 5 tapped layers, and projects context keys/values with k_proj and v_proj alone.
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
    "drafter fc": (4096, 20480),
    "k/v proj": (1024, 4096),
}
MS = (1, 2, 4, 8, 16)
L2_BYTES = 60 << 20


def log(*a):
    print(*a, flush=True)


def bench_ms(fn, rep: int = 40) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def graphed_per_call_ms(calls: list, target_ms: float = 1.0, est_ms: float = 0.02) -> float:
    """Median time per call of a CUDA graph that runs `calls` (one GEMM each, over different weight copies)
    round-robin, enough times for about target_ms per replay."""
    rounds = max(1, int(target_ms / (est_ms * len(calls))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for f in calls:
                f()
    ms = bench_ms(graph.replay)
    del graph
    return ms / (rounds * len(calls))


def stage_bandwidth() -> dict:
    from flashdraft.bench.synthetic import measure_bandwidth
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    read = a.numel() * 2 / (bench_ms(lambda: a.sum(dtype=torch.float32), rep=100) / 1e3) / 1e9
    del a
    copy = measure_bandwidth(torch.device("cuda"))
    return {"read_gb_s": read, "copy_gb_s": copy}


def check_shape(n: int, k: int, config: sg.SkinnyConfig) -> dict:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(16, k, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = x.float() @ w.float().T
    y = sg.launch(x, w, None, config)
    yc = F.linear(x, w)
    scale = ref.abs().max().item()
    out = {"triton_max_rel_err": (y.float() - ref).abs().max().item() / scale,
           "cublas_max_rel_err": (yc.float() - ref).abs().max().item() / scale,
           "triton_invariant": all(torch.equal(sg.launch(x[:m], w, None, config), y[:m]) for m in range(1, 16)),
           "cublas_invariant": all(torch.equal(F.linear(x[:m], w), yc[:m]) for m in range(1, 16)),
           "op_matches_launch": torch.equal(sg.skinny_linear(x, w), sg.launch(x, w))}
    out["ok"] = out["triton_invariant"] and out["triton_max_rel_err"] < 2 * out["cublas_max_rel_err"] + 1e-3
    return out


def stage_shape(name: str, n: int, k: int, sweep: bool, read_bw: float) -> dict:
    nbytes = n * k * 2
    copies = max(2, -(-3 * L2_BYTES // nbytes) + 1)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in MS}
    est = nbytes / 3.5e12 * 1e3
    default = sg.config_for(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    configs = sg.candidate_configs(n, k, wide=True) if sweep else sg.candidate_configs(n, k)[:8]
    if default not in configs:
        configs.insert(0, default)
    res = {"n": n, "k": k, "mb": nbytes / 1e6, "default": default.name, "check": check_shape(n, k, default),
           "cublas": {}, "triton": {}}
    log(f"[{name}] {n} x {k} ({nbytes / 1e6:.0f} MB, {copies} copies), default {default.name}, check {res['check']}")

    def gb_s(ms, m):
        return (nbytes + 2 * m * (n + k)) / (ms / 1e3) / 1e9

    for m in MS:
        x = xs[m]
        ms = graphed_per_call_ms([lambda w=w, x=x: F.linear(x, w) for w in weights], est_ms=est)
        res["cublas"][m] = {"us": ms * 1e3, "gb_s": gb_s(ms, m), "pct_read": 100 * gb_s(ms, m) / read_bw}
    # Tilings: all at M = 1 and 16; M = 2, 4, 8 for the default and the best at M = 1.
    for cfg in configs:
        row = res["triton"].setdefault(cfg.name, {})
        for m in (1, 16):
            x = xs[m]
            try:
                ms = graphed_per_call_ms([lambda w=w, x=x, c=cfg: sg.launch(x, w, None, c) for w in weights], est_ms=est)
                row[m] = {"us": ms * 1e3, "gb_s": gb_s(ms, m), "pct_read": 100 * gb_s(ms, m) / read_bw}
            except Exception as e:  # a tiling the compiler rejects (shared memory, registers)
                row[m] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    timed = {c: r for c, r in res["triton"].items() if "us" in r.get(1, {}) and "us" in r.get(16, {})}
    best = min(timed, key=lambda c: timed[c][1]["us"] + timed[c][16]["us"]) if timed else None
    res["best"] = best
    for cname in {default.name, best} - {None}:
        cfg = next(c for c in configs if c.name == cname)
        for m in (2, 4, 8):
            x = xs[m]
            ms = graphed_per_call_ms([lambda w=w, x=x, c=cfg: sg.launch(x, w, None, c) for w in weights], est_ms=est)
            res["triton"][cname][m] = {"us": ms * 1e3, "gb_s": gb_s(ms, m), "pct_read": 100 * gb_s(ms, m) / read_bw}
    cb = res["cublas"]
    log(f"  cuBLAS        " + "  ".join(f"M={m}: {cb[m]['us']:7.1f} us {cb[m]['pct_read']:4.0f}%" for m in MS))
    for cname, row in sorted(res["triton"].items(), key=lambda kv: kv[1].get(1, {}).get("us", 1e9)):
        tag = ("*" if cname == best else " ") + ("d" if cname == default.name else " ")
        log(f"  {cname:14s}{tag}" + "  ".join(
            f"M={m}: {row[m]['us']:7.1f} us {row[m]['pct_read']:4.0f}%" if "us" in row.get(m, {}) else
            (f"M={m}: {row[m]['error'][:60]}" if m in row else "") for m in MS))
    del weights, xs
    torch.cuda.empty_cache()
    return res


def stage_model_invariance() -> dict:
    """A whole target pass (random Qwen3 1B shape, bf16, eager): logits of 16 tokens verified in one pass vs the
    same tokens decoded one by one, same attention length. Bitwise equal rows need every op to be batch
    invariant (GEMMs, attention, norms); this shows what each GEMM backend leaves. The synthetic model's layers
    are scaled up 10x first: as built for the benchmark their outputs vanish in the residual stream's rounding."""
    from flashdraft.bench.synthetic import build_synthetic
    from flashdraft.layers import LayerPlan
    dev = torch.device("cuda")
    out = {}
    with torch.inference_mode():
        for gemm in ("cublas", "triton"):
            target, _ = build_synthetic("qwen3-1b", dev, torch.bfloat16, 256, plan=LayerPlan(gemm=gemm))
            for name, p in target.model.layers.named_parameters():
                if not name.endswith("norm.weight"):
                    p.mul_(10)
            g = torch.Generator(device=dev).manual_seed(0)
            prompt = torch.randint(0, 1000, (100,), device=dev, generator=g)
            tokens = torch.randint(0, 1000, (16,), device=dev, generator=g)
            cache = target.new_cache(300)
            target(prompt, torch.arange(100, device=dev), cache, 128)
            block, _ = target(tokens, torch.arange(100, 116, device=dev), cache, 128)
            single = torch.cat([target(tokens[i:i + 1], torch.arange(100 + i, 101 + i, device=dev), cache, 128)[0]
                                for i in range(16)])
            out[gemm] = {"rows_bitwise_equal": int((block == single).all(-1).sum()), "of": 16,
                         "max_abs_diff": (block - single).abs().max().item(),
                         "argmax_equal": bool((block.argmax(-1) == single.argmax(-1)).all())}
            log(f"  model invariance, {gemm}: {out[gemm]}")
    out["ops"] = op_invariance(dev)
    log(f"  per op, rows of 16 bitwise equal to the same rows run alone: {out['ops']}")
    return out


def op_invariance(dev) -> dict:
    """Which non-GEMM ops of a layer give a row different bits at T = 16 than at T = 1 (Qwen3-8B sizes)."""
    from flashdraft.layers import elementwise
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(16, 4096, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.rand(4096, device=dev, generator=g, dtype=torch.bfloat16)

    def rows_equal(f, inp, split=lambda t, i: t[i:i + 1]):
        full = f(inp)
        return sum(torch.equal(f(split(inp, i)), split(full, i)) for i in range(16))

    norm = lambda t: elementwise.rms_norm(t, w, 1e-6)  # noqa: E731
    res = {"rms_norm eager": rows_equal(norm, x),
           "rms_norm compiled": rows_equal(torch.compile(norm, dynamic=True), x)}
    q = torch.randn(32, 16, 128, device=dev, generator=g, dtype=torch.bfloat16)
    kv = [torch.randn(8, 256, 128, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2)]
    pos = torch.arange(100, 116, device=dev)

    def attn(qq, p):
        mask = torch.arange(256, device=dev)[None, :] <= p[:, None]
        return torch.nn.functional.scaled_dot_product_attention(qq[None], kv[0][None], kv[1][None], attn_mask=mask,
                                                                enable_gqa=True)[0]

    full = attn(q, pos)
    res["sdpa (masked, gqa)"] = sum(torch.equal(attn(q[:, i:i + 1], pos[i:i + 1]), full[:, i:i + 1])
                                    for i in range(16))
    return res


def stage_bench(variant: str) -> dict:
    from flashdraft.bench.synthetic import run
    report = run("qwen3-8b", "cuda", tokens=256, variants=(variant,), log=log)
    return report.to_dict()


def print_summary(results: dict) -> None:
    bw = results.get("bandwidth", {"read_gb_s": 4200.0, "copy_gb_s": 4200.0})
    log(f"\n== {results['device']}, torch {results['torch']}, triton {results['triton']}: read "
        f"{bw['read_gb_s']:.0f} GB/s, copy {bw['copy_gb_s']:.0f} GB/s; total {results['total_s']:.0f} s")
    log(f"{'shape':12s} {'MB':>6s}  {'cuBLAS us M=1/16 (%read)':>28s}  {'triton default us M=1/16 (%read)':>34s}"
        f"  {'best tiling':14s} {'us M=1/16':>13s}  ok")
    for name, r in results["gemm"].items():
        c, d = r["cublas"], r["triton"].get(r["default"], {})
        b = r["triton"].get(r["best"], {}) if r.get("best") else {}

        def pair(row):
            if "us" not in row.get(1, {}) or "us" not in row.get(16, {}):
                return "-"
            return f"{row[1]['us']:.1f}/{row[16]['us']:.1f} ({row[1]['pct_read']:.0f}/{row[16]['pct_read']:.0f}%)"

        bp = f"{b[1]['us']:.1f}/{b[16]['us']:.1f}" if "us" in b.get(1, {}) and "us" in b.get(16, {}) else "-"
        log(f"{name:12s} {r['mb']:6.0f}  {pair(c):>28s}  {r['default'] + ' ' + pair(d):>34s}  {str(r['best']):14s} "
            f"{bp:>13s}  {r['check']['ok']}")
    for variant in ("graphs+compiled", "graphs+compiled+triton"):
        r = results.get(f"bench {variant}")
        if r is None:
            if f"bench {variant}" in results["errors"]:
                log(f"{variant:24s} FAILED (see errors in gemm.json)")
            continue
        log(f"{variant:24s} baseline {r['baseline_tok_s']:6.1f} tok/s "
            f"({100 * r['baseline_tok_s'] / r['baseline_roofline_tok_s']:.0f}% of roofline "
            f"{r['baseline_roofline_tok_s']:.0f}); decode {r['decode_step_ms']:.3f} ms, verify {r['verify_step_ms']:.3f}"
            f" ms, draft {r['draft_step_ms']:.3f} ms; speedup tau " + " ".join(
                f"{d['tau_planned']}:{d['speedup']:.2f}x{'' if d['identical'] else '(!)'}" for d in r["dflash"]))
    base, tri = results.get("bench graphs+compiled"), results.get("bench graphs+compiled+triton")
    if base and tri:
        log("triton DFlash vs the cuBLAS baseline: " + " ".join(
            f"tau {d['tau_planned']}: {d['dflash_tok_s'] / base['baseline_tok_s']:.2f}x" for d in tri["dflash"]))
    if "model invariance" in results:
        inv = results["model invariance"]
        log("verify(16) vs 16 x decode(1), rows bitwise equal: " + ", ".join(
            f"{k} {v['rows_bitwise_equal']}/16 (max diff {v['max_abs_diff']:.3g})" for k, v in inv.items()
            if k != "ops") + f"; per op: {inv.get('ops')}")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    import triton
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "sms": torch.cuda.get_device_properties(0).multi_processor_count,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "errors": {}}
    sweep = "--sweep" in sys.argv

    def save():
        (out / "gemm.json").write_text(json.dumps(results, indent=1, default=str))

    def stage(key, fn, *args):
        t = time.time()
        try:
            results[key] = fn(*args)
        except Exception as e:
            results["errors"][key] = traceback.format_exc()
            log(f"[{key}] FAILED: {type(e).__name__}: {e}")
        log(f"[{key}] {time.time() - t:.0f} s")
        save()

    t0 = time.time()
    stage("bandwidth", stage_bandwidth)
    bw = results.get("bandwidth", {"read_gb_s": 4200.0, "copy_gb_s": 4200.0})
    log(f"read {bw['read_gb_s']:.0f} GB/s, copy {bw['copy_gb_s']:.0f} GB/s")
    results["gemm"] = {}
    for name, (n, k) in SHAPES.items() if "--no-gemm" not in sys.argv else ():
        t = time.time()
        try:
            results["gemm"][name] = stage_shape(name, n, k, sweep, bw["read_gb_s"])
        except Exception as e:
            results["errors"][f"gemm {name}"] = traceback.format_exc()
            log(f"[gemm {name}] FAILED: {type(e).__name__}: {e}")
        log(f"[gemm {name}] {time.time() - t:.0f} s")
        save()
    stage("model invariance", stage_model_invariance)
    gc.collect()
    torch.cuda.empty_cache()
    if "--no-bench" not in sys.argv:
        for variant in ("graphs+compiled", "graphs+compiled+triton"):
            stage(f"bench {variant}", stage_bench, variant)
            gc.collect()
            torch.cuda.empty_cache()
    results["total_s"] = time.time() - t0
    save()

    print_summary(results)
    if results["errors"]:
        log(f"errors in: {', '.join(results['errors'])}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
