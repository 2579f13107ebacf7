"""Time flashdraft.quant.mma_kernels over a grid of tilings (direct loads, and shared-memory rings of STAGES
super-blocks for the types that take one) on the k-quant shapes of the Q4_K_S-shaped Gemma-4-31B and the
Q4_K_M-shaped Qwen3-8B (random valid blocks, CUDA graphs over weight copies that defeat the L2), check each result
(against dequantize + matmul, M = 1 against row 0 of M = 16, and every tiling of a K split against the others: the
same bits), and print the TILINGS table: per shape the K split with the lowest M = 1 + M = 16 time, each with its
fastest tiling at M = 1 and at M = 16, next to the best without a ring, the default tiling and the Triton kernel.
Q4_K weights whose rows fill the package's chunks are timed as the loader keeps them, super-block-major
(Q4_K_COLUMNS, flashdraft.quant.q4k_columns), unless --gguf-order (the order of every sweep before session 48: the
adopted tilings were chosen in it). --copy-engine adds, for Q4_K_COLUMNS on compute capability 9.0, each ring
filled by the copy engine (MmaTiling.bulk). --adopted-only times only the adopted tilings, the default and the
Triton kernel: a quick check of a kernel change against what runs.

Usage (GPU machine, repo root):
    PYTHONPATH=src python scripts/gpu/mma_tilings.py OUT [--only gemma-q4k,gemma-q5k,...] [--no-rings]
        [--gguf-order] [--copy-engine] [--adopted-only] [--budget-s S]
--only: the shape sets (SETS below; default all); --no-rings: direct loads only; --budget-s: no new shape is
started past this many seconds (what was measured is printed and written).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_run import as_loaded, bench_ms, copies_for, random_blocks, rel_err  # noqa: E402

from flashdraft.kernels import gguf_triton  # noqa: E402
from flashdraft.quant import dequantize, mma_kernels, q4k_columns  # noqa: E402
from flashdraft.quant.formats import row_bytes  # noqa: E402
from flashdraft.quant.mma_kernels import MmaTiling  # noqa: E402

STAGES = (3, 4)  # shared-memory ring depths tried beside the direct loads
DIRECT = ((2, 1), (4, 1), (2, 6))  # (warps, min_blocks) of the direct-load tilings, with 1-2 tiles a warp
RING = ((2, 1), (4, 1), (4, 2))    # the same for rings (shared memory bounds the blocks a multiprocessor holds)
# name -> (type, {shape: (N, K)}): Gemma-4-31B Q4_K_S (Q5_K: attn_v of layers 0-3, ffn_down of layers 0-6; Q6_K:
# the tied embedding / LM head) and Qwen3-8B Q4_K_M (Q6_K: attn_v and ffn_down of half the layers, the LM head)
SETS = {
    "gemma-q4k": ("Q4_K", {"gate/up": (21504, 5376), "down": (5376, 21504), "sliding q": (8192, 5376),
                           "sliding k/v": (4096, 5376), "sliding o": (5376, 8192), "full q": (16384, 5376),
                           "full k": (2048, 5376), "full o": (5376, 16384)}),
    # the fused projections of Gemma4LM.prepare (sliding q|k|v is 16384 x 5376, full q's shape)
    "gemma-q4k-fused": ("Q4_K", {"full q|k": (18432, 5376), "gate|up": (43008, 5376)}),
    # the Q4_K products of a Gemma-4-31B decode step as Gemma4LM.prepare fuses them, the most time first (60 gate|up
    # and down, 50 sliding q|k|v and o, 10 full q|k and o)
    "gemma-step": ("Q4_K", {"gate|up": (43008, 5376), "down": (5376, 21504), "sliding q|k|v": (16384, 5376),
                            "sliding o": (5376, 8192), "full q|k": (18432, 5376), "full o": (5376, 16384)}),
    "gemma-q5k": ("Q5_K", {"sliding v": (4096, 5376), "down": (5376, 21504)}),
    "gemma-q6k": ("Q6_K_LANES", {"lm head": (262144, 5376)}),
    "qwen-q4k": ("Q4_K", {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (12288, 4096), "down": (4096, 12288),
                          "embedding": (151936, 4096)}),
    "qwen-q6k": ("Q6_K_LANES", {"v": (1024, 4096), "down": (4096, 12288), "lm head": (151936, 4096)}),
    # Qwen3-8B Q4_K_M's fused projections (q|k|v where attn_v is Q4_K too, else q|k; gate|up in every layer)
    "qwen-q4k-fused": ("Q4_K", {"q|k|v": (6144, 4096), "q|k": (5120, 4096), "gate|up": (24576, 4096)}),
    # Qwen3-8B Q4_K_M's own Q4_K k (beside a Q6_K v) and down (half the layers)
    "qwen-q4k-rest": ("Q4_K", {"k": (1024, 4096), "down": (4096, 12288)}),
    # the Q5_K Gemma-4-31B drafter (side_by_side.sh's default for a quantized target): its block pass's fused
    # q|k|v, o, gate|up and down (16 rows), and its context projection's fc and k/v (a step's accepted rows)
    "gemma-drafter-q5k": ("Q5_K", {"gate|up": (21504, 5376), "down": (5376, 10752), "q|k|v": (10240, 5376),
                                   "o": (5376, 8192), "fc": (5376, 32256), "k/v": (1024, 5376),
                                   "k|v": (2048, 5376)}),
    # a Q5_K drafter of Qwen3-8B's shape (side_by_side_gguf.py's for a Qwen3 target: 5 layers, 5 taps): its block
    # pass's products and its context projection's fc and [k; v] rows (DFlashDrafter.context_kv_blocks)
    "qwen-drafter-q5k": ("Q5_K", {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (24576, 4096),
                                  "down": (4096, 12288), "fc": (4096, 20480), "k|v": (2048, 4096)}),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default=",".join(SETS), help="comma-separated shape sets: " + ", ".join(SETS))
    ap.add_argument("--no-rings", action="store_true")
    ap.add_argument("--gguf-order", action="store_true", help="Q4_K in GGUF's row order, not the package's chunks")
    ap.add_argument("--copy-engine", action="store_true",
                    help="Q4_K_COLUMNS rings filled by the copy engine too (compute capability 9.0)")
    ap.add_argument("--adopted-only", action="store_true", help="only the adopted tilings, the default and Triton")
    ap.add_argument("--budget-s", type=float, default=float("inf"))
    args = ap.parse_args()
    if args.adopted_only and (args.no_rings or args.copy_engine):
        ap.error("--adopted-only times the adopted tilings as they are: it takes neither --no-rings nor --copy-engine")
    unknown = [name for name in args.only.split(",") if name not in SETS]
    if unknown:
        ap.error(f"unknown shape set(s) {unknown}: choose from {list(SETS)}")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, table = [], {}
    t0 = time.time()
    shapes = [(f"{name} {shape}", qtype, n, k) for name in args.only.split(",")
              for qtype, of_set in [SETS[name]] for shape, (n, k) in of_set.items()]
    for shape, qtype, n, k in shapes:
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: {shape} and later shapes not measured", flush=True)
            break
        nsb = k // 256
        ws = [random_blocks(qtype, n, k, gen, dev)
              for _ in range(copies_for(n * row_bytes(qtype, k), False))]
        x = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=gen)
        ref = x.double() @ dequantize(ws[0], qtype).double().T
        ws, qtype = as_loaded(qtype, ws, args.gguf_order)
        chunk_rows = q4k_columns.CHUNK_ROWS if qtype == q4k_columns.QTYPE else 0  # the Triton kernel's view of it
        default = mma_kernels.default_tiling(n, k)
        splits = [d for d in range(1, 17) if nsb % d == 0]
        grid = list(dict.fromkeys([*mma_kernels.tilings_for(qtype, n, k), default]))  # as adopted
        if not args.adopted_only:
            grid += [MmaTiling(r, w, s, b) for r, (w, b), s in itertools.product((1, 2), DIRECT, splits)]
        if qtype in mma_kernels.RING_ROW_BYTES and not args.no_rings and not args.adopted_only:
            fills = (False, True) if args.copy_engine and qtype == q4k_columns.QTYPE else (False,)
            grid += [MmaTiling(r, w, s, b, st, bulk) for st, r, (w, b), s, bulk
                     in itertools.product(STAGES, (1, 2), RING, splits, fills)]
        grid = list(dict.fromkeys(grid))
        results, by_split = [], {}
        for tiling in [None] + grid:
            def call(w, m, tiling=tiling):
                if tiling is None:
                    return gguf_triton.launch(x[:m], w, n, q4k_columns.file_type(qtype), chunk_rows=chunk_rows)
                return mma_kernels.launch(x[:m], w, n, qtype, tiling)
            try:
                y16, y1 = call(ws[0], 16), call(ws[0], 1)
                ok = rel_err(y16, ref) < 4e-3 and torch.equal(y16[:1], y1)
                if tiling is not None:  # every tiling of one K split does the same arithmetic: the same bits
                    ok = ok and torch.equal(by_split.setdefault(tiling.split, y16), y16)
                us = [1000 * bench_ms([lambda w=w, m=m: call(w, m) for w in ws], False) for m in (1, 16)]
            except Exception as e:  # noqa: BLE001 - reported; the other tilings still run
                print(f"{shape} {tiling}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            name = "triton" if tiling is None else (f"r{tiling.r_tiles} w{tiling.warps} s{tiling.split} "
                                                    f"b{tiling.min_blocks} st{tiling.stages}"
                                                    + " bulk" * tiling.bulk)
            row = {"shape": shape, "qtype": qtype, "n": n, "k": k, "tiling": name, "us_m1": us[0], "us_m16": us[1],
                   "ok": ok, "default": tiling == default}
            rows.append(row)
            results.append((tiling, row))
        triton = next((r for t, r in results if t is None), {"us_m1": float("nan"), "us_m16": float("nan")})
        good = [(t, r) for t, r in results if t is not None and r["ok"]]
        if not good:
            print(f"{shape}: no tiling gave correct, invariant results", flush=True)
            continue
        # per K split the fastest tiling at M = 1 and at M = 16 (one split for both: the same bits); the split
        # with the lowest sum of the two
        pairs = []
        for split in sorted({t.split for t, _ in good}):
            of_split = [(t, r) for t, r in good if t.split == split]
            few = min(of_split, key=lambda tr: tr[1]["us_m1"])
            many = min(of_split, key=lambda tr: tr[1]["us_m16"])
            pairs.append((few[1]["us_m1"] + many[1]["us_m16"], few, many))
        _, (few_t, few), (many_t, many) = min(pairs, key=lambda p: p[0])
        dflt = next((r for t, r in good if t == default), None)
        table[shape] = {"qtype": qtype, "n": n, "k": k, "best": [few["tiling"], many["tiling"]],
                        "best_us": [few["us_m1"], many["us_m16"]],
                        "default_us": [dflt["us_m1"], dflt["us_m16"]] if dflt else None,
                        "triton_us": [triton["us_m1"], triton["us_m16"]],
                        "tilings": [[t.r_tiles, t.warps, t.split, t.min_blocks, t.stages] + [True] * t.bulk
                                    for t in (few_t, many_t)],
                        "best_direct_us": min(([r["us_m1"], r["us_m16"]] for t, r in good if t.stages == 0),
                                              key=sum),
                        "all_ok": all(r["ok"] for _, r in results if _ is not None)}
        direct = table[shape]["best_direct_us"]
        print(f"{shape:22s} {n}x{k}: best {few['tiling']} / {many['tiling']}: {few['us_m1']:.1f} / "
              f"{many['us_m16']:.1f} us; best without a ring {direct[0]:.1f} / {direct[1]:.1f}; default "
              f"{table[shape]['default_us']}; triton {triton['us_m1']:.1f} / {triton['us_m16']:.1f}; "
              f"all correct and invariant: {table[shape]['all_ok']}", flush=True)
        del ws, ref
        torch.cuda.empty_cache()
        write(out, rows, table, t0)
    write(out, rows, table, t0)
    print("\nTILINGS = {")
    for shape, t in table.items():
        few, many = (code(MmaTiling(*tiling)) for tiling in t["tilings"])
        key = f"(\"{q4k_columns.file_type(t['qtype'])}\", {t['n']}, {t['k']})"
        print(f"    {key}: ({few}, {many}),  # {shape}: {t['best_us'][0]:.1f} / "
              f"{t['best_us'][1]:.1f} us at M = 1 / 16")
    print("}")
    return 0


def code(t: MmaTiling) -> str:
    """The tiling as TILINGS writes it: five numbers, then bulk by name where set."""
    return f"MmaTiling({t.r_tiles}, {t.warps}, {t.split}, {t.min_blocks}, {t.stages}{', bulk=True' * t.bulk})"


def write(out: Path, rows: list, table: dict, t0: float) -> None:
    """What has been measured so far (rewritten after each shape: a call that runs out of time keeps it)."""
    (out / "mma_tilings.json").write_text(json.dumps({"rows": rows, "table": table, "elapsed_s": time.time() - t0},
                                                     indent=2))


if __name__ == "__main__":
    sys.exit(main())
