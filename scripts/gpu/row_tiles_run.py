"""The skinny GEMM over batched steps' row counts (issue #23): time per call of each GEMM of a fused Qwen3-8B layer
(and the LM head, the drafter's fc and context k/v) at 16 to 256 rows, with the kernel's own choice of row tiles
per program against one row tile per program, and whether every row keeps the bits it has alone.

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/row_tiles_run.py OUT_DIR
Writes OUT_DIR/row_tiles.json and prints one line per (GEMM, rows).
"""
from __future__ import annotations

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
ROWS = (16, 32, 48, 64, 128, 256)
PICKED = (0, 17, 38, 63, 200, 255)  # rows checked against themselves alone


def call(x, w, fusion: str, kw: dict, m: int, tiles: int | None):
    part = {a: (b[:m] if a == "residual" else b) for a, b in kw.items()}
    return sg.launch(x[:m], w, None, None, row_tiles=tiles, **part)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, (rows, k, fusion) in CASES.items():
        n = rows // 2 if "gated" in fusion else rows
        x = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
        kw = fusion_kwargs(fusion, x, n, k)
        w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02
        alone = {i: call(x[i:], w, fusion, {a: (b[i:] if a == "residual" else b) for a, b in kw.items()}, 1, None)
                 for i in PICKED}
        copies = max(2, -(-3 * L2_BYTES // (rows * k * 2)))
        weights = [w] + [torch.randn_like(w) * 0.02 for _ in range(copies - 1)]
        floor_us = rows * k * 2 / 4.2e12 * 1e6
        for m in ROWS:
            y = call(x, w, fusion, kw, m, None)
            same = all(torch.equal(y[i:i + 1], alone[i]) for i in PICKED if i < m)
            us = {}
            for label, tiles in (("chosen", None), ("one", 1)):
                fns = [lambda w=w, t=tiles: call(x, w, fusion, kw, m, t) for w in weights]
                us[label] = graphed_per_call_ms(fns, est_ms=rows * k * 2 / 4e12 * 1e3) * 1e3
            results.append({"case": name, "rows": m, "row_tiles": sg.row_tiles_for(-(-m // 16)),
                            "us": us["chosen"], "us_one_tile": us["one"], "invariant": same})
            print(f"{name:20s} M={m:3d} row tiles {sg.row_tiles_for(-(-m // 16))}: {us['chosen']:7.1f} us "
                  f"(one tile a program {us['one']:7.1f} us; weights at 4.2 TB/s {floor_us:6.1f} us)  "
                  f"rows as alone {same}", flush=True)
        del weights
        torch.cuda.empty_cache()
        (out / "row_tiles.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
