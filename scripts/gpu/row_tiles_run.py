"""The skinny GEMM over batched steps' row counts (issue #23): time per call of each GEMM of a fused Qwen3-8B layer
(and the LM head, the drafter's fc and context k/v) at 1, 16, 64 and 256 rows, with the model's tiling and with
tilings of 64-row tiles (256 rows only where 64 beat the model's tiling), and whether every row keeps the bits it has
alone (at every row count), and those it has with the same tiling's 16-row tiles (that tiling then timed at 1 and
16 rows too: a model could take it up to 16 rows and the 64-row one beyond).

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/row_tiles_run.py OUT_DIR [CASE ...]
Writes OUT_DIR/row_tiles.json and prints one line per (GEMM, rows).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fused_gemm_run import fusion_kwargs  # noqa: E402
from gemm_run import L2_BYTES, graphed_per_call_ms  # noqa: E402

from flashdraft.layers import skinny_gemm as sg  # noqa: E402

# name -> (weight rows, K, fusion), as the fused layers call them
CASES = {
    "qkv+norm": (6144, 4096, "norm"),
    "o+residual": (4096, 4096, "residual"),
    "gate_up+norm+gated": (24576, 4096, "norm+gated"),
    "down+residual": (4096, 12288, "residual"),
    "lm_head": (151936, 4096, ""),
    "drafter fc": (4096, 20480, ""),
    "drafter k/v+norm": (2048, 4096, "norm"),
}
ROWS = (1, 16, 64, 256)
PICKED = (0, 17, 38, 63, 200, 255)  # rows checked against themselves alone
C = sg.SkinnyConfig
# Tilings of 64-row tiles (one tensor-core product over a batched pass's rows, HGMMA 64x64 or 64x32 on sm_90: see
# scripts/kernel_sass.py), weight tile on either side. Fewer stages where one program's shared memory would leave the
# multiprocessor one program (the products of one K step form a dependent chain: a second program hides its latency);
# 16- and 32-wide weight tiles (x on the left) and split K for the 4096-feature shapes, which give 64-wide tiles only
# 64 programs.
CANDIDATES = [C(64, 128, 1, 4, 6, swap=True, block_m=64), C(64, 128, 1, 4, 4, swap=True, block_m=64),
              C(64, 128, 1, 4, 3, swap=True, block_m=64), C(128, 64, 1, 4, 6, swap=True, block_m=64),
              C(128, 64, 1, 4, 4, swap=True, block_m=64), C(64, 64, 1, 4, 8, swap=True, block_m=64),
              C(128, 128, 1, 8, 4, swap=True, block_m=64), C(64, 128, 1, 4, 4, block_m=64),
              C(64, 128, 1, 4, 3, block_m=64), C(128, 64, 1, 8, 4, block_m=64), C(32, 128, 1, 4, 4, block_m=64),
              C(16, 128, 1, 4, 4, block_m=64), C(64, 128, 2, 4, 4, swap=True, block_m=64),
              C(64, 128, 2, 4, 3, swap=True, block_m=64)]


def call(x, w, kw: dict, m: int, config, start: int = 0):
    part = {a: (b[start:start + m] if a == "residual" else b) for a, b in kw.items()}
    return sg.launch(x[start:start + m], w, None, config, **part)


def per_call_us(x, weights: list, kw: dict, m: int, config) -> float:
    """us a call of m rows inside a CUDA graph, round-robin over the weight copies (so they come from HBM)."""
    rows, k = weights[0].shape
    return graphed_per_call_ms([lambda w=w: call(x, w, kw, m, config) for w in weights],
                               est_ms=rows * k * 2 / 4e12 * 1e3) * 1e3


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = []
    chosen = sys.argv[2:] or list(CASES)
    for name in chosen:
        rows, k, fusion = CASES[name]
        n = rows // 2 if "gated" in fusion else rows
        x = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
        kw = fusion_kwargs(fusion, x, n, k)
        w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02
        copies = max(2, -(-3 * L2_BYTES // (rows * k * 2)))
        weights = [w] + [torch.randn_like(w) * 0.02 for _ in range(copies - 1)]
        floor_us = rows * k * 2 / 4.2e12 * 1e6
        model = sg.GATED_CONFIGS.get((rows, k), sg.GATED_DEFAULT) if "gated" in fusion else sg.config_for(rows, k)
        print(f"{name}: weights at 4.2 TB/s {floor_us:.1f} us", flush=True)
        model_us_64 = float("inf")
        for config in [model] + [c for c in CANDIDATES if c != model]:
            if ("norm" in fusion or "gated" in fusion) and config.split_k > 1:
                continue
            try:
                alone = {i: call(x, w, kw, 1, config, i) for i in PICKED}
                same = all(torch.equal(call(x, w, kw, m, config)[i:i + 1], alone[i])
                           for m in ROWS for i in PICKED if i < m)
                # 256 rows (16 streams) only where 64 rows beat the model's tiling: the run's time goes to the rest
                us = [per_call_us(x, weights, kw, m, config) for m in ROWS[:-1]]
                if config == model or us[-1] < model_us_64:
                    us.append(per_call_us(x, weights, kw, ROWS[-1], config))
                if config == model:
                    model_us_64 = us[ROWS.index(64)]
                # the same tiling with 16-row tiles: do its rows alone have the 64-row tile's bits? (then a pass
                # could take 64-row tiles past 16 rows only, and one stream's steps the 16-row tiling, timed here
                # at 1 and 16 rows)
                narrow = dataclasses.replace(config, block_m=16)
                as_16 = (all(torch.equal(call(x, w, kw, 64, config)[i:i + 1], call(x, w, kw, 1, narrow, i))
                             for i in PICKED if i < 64) if config.block_m == 64 else None)
                narrow_us = [per_call_us(x, weights, kw, m, narrow) for m in ROWS[:2]] if as_16 else None
            except Exception as e:  # a tiling that does not fit (shared memory, registers): report, go on
                print(f"  {config.name:22s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            results.append({"case": name, "config": config.name, "model": config == model, "rows": ROWS[:len(us)],
                            "us": us, "invariant": same, "bits_as_16_row_tiles": as_16,
                            "16_row_tiles_us": narrow_us})
            print(f"  {config.name:22s}{' (model)' if config == model else '        '} "
                  + "  ".join(f"M={m} {u:7.1f}" for m, u in zip(ROWS, us))
                  + f" us  rows as alone {same}, as with 16-row tiles {as_16}"
                  + (f" (16-row tiles: M=1 {narrow_us[0]:.1f}, M=16 {narrow_us[1]:.1f} us)" if narrow_us else ""),
                  flush=True)
        del weights
        torch.cuda.empty_cache()
        (out / "row_tiles.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
