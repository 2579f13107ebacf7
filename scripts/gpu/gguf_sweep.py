"""Tiling sweep of the GGUF Triton kernels at Gemma-4-31B shapes (for choosing gguf_triton.config_for).

Usage (repo root, CUDA): PYTHONPATH=src python scripts/gpu/gguf_sweep.py OUT_DIR [--budget-s S]
Also writes OUT_DIR/gguf_configs.json, the fastest correct tiling per shape, which gguf_run.py --configs reads
(and which can be copied into gguf_triton.CONFIGS).
For each (qtype, shape) and each candidate tiling: relative error against dequantize + matmul, bitwise M=1 vs
M=16 rows, and the median time per call at M = 1 and 16 (CUDA graph over enough weight copies to defeat L2,
triton.testing.do_bench), next to the roofline. Writes OUT_DIR/gguf_sweep.json; prints the table as it goes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_run import GB, SHAPES_31B, bench_ms, copies_for, random_blocks, rel_err  # noqa: E402

# Most important first (the sweep stops at its time budget).
CASES = [("Q4_K", "gate_up"), ("Q4_K", "down"), ("Q4_K", "q_sliding"), ("Q4_K", "kv_sliding"), ("Q4_K", "o_sliding"),
         ("Q6_K_LANES", "lm_head"), ("Q4_K", "q_full"), ("Q4_K", "o_full"), ("Q4_K", "k_full"), ("Q5_K", "down"),
         ("Q5_K", "kv_sliding"), ("Q8_0", "d_gate_up"), ("Q8_0", "d_down"), ("Q8_0", "d_q"), ("Q8_0", "d_o"),
         ("Q8_0", "d_fc"), ("Q8_0", "d_kv")]


def candidates(tk, qtype, n, k, sms):
    h = tk.heuristic_config
    out = [h(qtype, n, k, sms), h(qtype, n, k, sms, num_stages=1), h(qtype, n, k, sms, num_stages=1, block_k=256),
           h(qtype, n, k, sms, block_k=128), h(qtype, n, k, sms, num_warps=8), h(qtype, n, k, sms, block_n=32)]
    seen, uniq = set(), []
    for c in out:
        if c not in seen and (-(-k // c.block_k)) % c.split_k == 0:
            seen.add(c)
            uniq.append(c)
    return uniq


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget-s", type=float, default=150.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    import triton.testing

    from flashdraft.quant import dequantize
    from flashdraft.kernels import gguf_triton as tk

    t0 = time.time()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(1)
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev).normal_()
    bw = (2 << 30) / (triton.testing.do_bench(lambda: a.sum(), return_mode="median") / 1000) / GB
    a = None  # free it
    rows, best_rows = [], []
    print(f"read bandwidth {bw:.0f} GB/s, {sms} SMs", flush=True)
    for qtype, shape in CASES:
        if time.time() - t0 > args.budget_s:
            break
        n, k = SHAPES_31B[shape]
        blocks = random_blocks(qtype, n, k, gen, dev)
        wb = dequantize(blocks, qtype).to(torch.bfloat16)
        x = torch.randn(16, k, device=dev, generator=gen).to(torch.bfloat16)
        ref = x.float() @ wb.float().T
        del wb
        copies = [blocks] + [blocks.clone() for _ in range(copies_for(blocks.numel(), False) - 1)]
        roof_us = blocks.numel() / (bw * GB) * 1e6
        for cfg in candidates(tk, qtype, n, k, sms):
            if time.time() - t0 > args.budget_s:
                print("budget reached", flush=True)
                break
            row = {"qtype": qtype, "shape": shape, "n": n, "k": k, "config": cfg.name, "roofline_us": roof_us,
                   "fields": dataclasses.asdict(cfg)}
            try:
                y = tk.launch(x, blocks, n, qtype, cfg)
                row["rel_err"] = rel_err(y, ref)
                row["invariant"] = bool(torch.equal(tk.launch(x[:1], blocks, n, qtype, cfg), y[:1]))
                for m in (1, 16):
                    xm = x[:m].contiguous()
                    row[f"us_{m}"] = 1000 * bench_ms([lambda c=c, xm=xm: tk.launch(xm, c, n, qtype, cfg)
                                                      for c in copies], False)
                print(f"{qtype} {shape:10s} {cfg.name:16s} err {row['rel_err']:.1e} inv {row['invariant']} "
                      f"M=1 {row['us_1']:7.1f} us  M=16 {row['us_16']:7.1f} us  roof {roof_us:6.1f} us "
                      f"({100 * roof_us / row['us_1']:.0f}%)", flush=True)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"{qtype} {shape:10s} {cfg.name:16s} FAILED {row['error'][:200]}", flush=True)
            rows.append(row)
            (args.out / "gguf_sweep.json").write_text(json.dumps(rows, indent=2))
        mine = [r for r in rows if r["qtype"] == qtype and r["shape"] == shape and "us_16" in r and r["invariant"]
                and r["rel_err"] < 1e-2]
        if mine:
            best = min(mine, key=lambda r: r["us_1"] + r["us_16"])
            best_rows.append({"qtype": qtype, "n": n, "k": k, **best["fields"]})
            (args.out / "gguf_configs.json").write_text(json.dumps(best_rows, indent=2))
            print(f"   best {qtype} {shape}: {best['config']} ({best['us_1']:.1f} / {best['us_16']:.1f} us)", flush=True)
        del copies, blocks
        torch.cuda.empty_cache()
    print(f"sweep done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
