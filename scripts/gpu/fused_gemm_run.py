"""The fused skinny GEMMs of DecoderLayer.fused_forward against the plain kernel at Qwen3-8B's shapes: time per
call (inside a CUDA graph, weights rotated past the L2) of each fusion with the plain kernel's tiling and with
other tilings, at M = 1 and 16, and whether each fused tiling's rows are bitwise batch-invariant.

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/fused_gemm_run.py OUT_DIR [CASE ...]
(CASE: names of CASES to run; all by default)
Writes OUT_DIR/fused_gemm.json and prints one line per (shape, fusion, tiling).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_run import L2_BYTES, graphed_per_call_ms  # noqa: E402

from flashdraft.layers import skinny_gemm as sg  # noqa: E402
from flashdraft.layers.skinny_gemm import SkinnyConfig  # noqa: E402

# name -> (weight rows, K, fusion): the four GEMMs of a fused Qwen3-8B layer, and the LM head with the final norm
CASES = {
    "qkv+norm": (6144, 4096, "norm"),
    "o+residual": (4096, 4096, "residual"),
    "gate_up+norm+gated": (24576, 4096, "norm+gated"),
    "gate_up+gated": (24576, 4096, "gated"),
    "down+residual": (4096, 12288, "residual"),
    "llama gate_up+norm+gated": (28672, 4096, "norm+gated"),
}
SWAPPED = [SkinnyConfig(64, 128, 1, 4, s, swap=True) for s in (3, 4, 6)] + [
    SkinnyConfig(32, 128, 1, 4, s, swap=True) for s in (4, 6)] + [
    SkinnyConfig(64, 256, 1, 4, 3, swap=True), SkinnyConfig(64, 128, 1, 8, 4, swap=True)]
PLAIN = [SkinnyConfig(16, 128, 1, 2, 8), SkinnyConfig(32, 128, 1, 4, 6), SkinnyConfig(16, 256, 1, 2, 4),
         SkinnyConfig(32, 64, 1, 4, 8)]


def fusion_kwargs(fusion: str, x: torch.Tensor, n: int, k: int) -> dict:
    kw = {}
    if "norm" in fusion:  # the norm's weight is folded into W beforehand: only the row scale is left
        kw["rms_norm_eps"] = 1e-6
    if "gated" in fusion:
        kw["gated"] = True
    if "residual" in fusion:
        kw["residual"] = torch.randn(x.shape[0], n, device="cuda", dtype=x.dtype)
    return kw


def time_case(rows: int, k: int, fusion: str | None, config: SkinnyConfig, m: int) -> float:
    copies = max(2, -(-3 * L2_BYTES // (rows * k * 2)))
    weights = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    n = rows // 2 if fusion and "gated" in fusion else rows
    kw = fusion_kwargs(fusion or "", x, n, k)
    calls = [lambda w=w: sg.launch(x, w, None, config, **kw) for w in weights]
    return graphed_per_call_ms(calls, est_ms=rows * k * 2 / 4e12 * 1e3)


def invariant(rows: int, k: int, fusion: str, config: SkinnyConfig) -> bool:
    w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    n = rows // 2 if "gated" in fusion else rows
    kw = fusion_kwargs(fusion, x, n, k)
    full = sg.launch(x, w, None, config, **kw)
    for m in (1, 3, 8):
        part_kw = {a: (b[:m] if a == "residual" else b) for a, b in kw.items()}
        if not torch.equal(sg.launch(x[:m], w, None, config, **part_kw), full[:m]):
            return False
    return True


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = []
    chosen = sys.argv[2:] or list(CASES)
    for name, (rows, k, fusion) in ((name, CASES[name]) for name in chosen):
        plain = sg.config_for(rows, k)
        floor_us = rows * k * 2 / 4.2e12 * 1e6
        base = {m: time_case(rows, k, None, plain, m) for m in (1, 16)}
        print(f"{name:20s} plain {plain.name:16s} M=1 {base[1] * 1e3:7.1f} us  M=16 {base[16] * 1e3:7.1f} us  "
              f"(floor at 4.2 TB/s {floor_us:6.1f} us)", flush=True)
        results.append({"case": name, "fusion": None, "config": plain.name, "us": [base[1] * 1e3, base[16] * 1e3]})
        candidates = [plain] + [c for c in (SWAPPED + PLAIN) if c != plain]
        if "gated" in fusion:  # the gated default, and the [2I, K] tiling with half its stages
            candidates[1:1] = [sg.GATED_CONFIGS.get((rows, k), sg.GATED_DEFAULT), dataclasses.replace(plain, num_stages=max(2, (plain.num_stages + 1) // 2))]
        for config in candidates:
            try:
                us = [time_case(rows, k, fusion, config, m) * 1e3 for m in (1, 16)]
                ok = invariant(rows, k, fusion, config)
            except Exception as e:  # a tiling that does not fit (shared memory, registers): report, go on
                print(f"  {fusion:12s} {config.name:16s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            results.append({"case": name, "fusion": fusion, "config": config.name, "us": us, "invariant": ok})
            print(f"  {fusion:12s} {config.name:16s} M=1 {us[0]:7.1f} us  M=16 {us[1]:7.1f} us  invariant {ok}",
                  flush=True)
        (out / "fused_gemm.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
