"""Whether a k-quant product's grid ends in a short last wave: the kernel's time against its output rows N around
a real shape's, with the shape's adopted tilings, beside the grid's blocks over those a GPU holds at once.

The Q4_K products stream at ~2.0-2.1 TB/s on the H100 even at 130 MB (Gemma-4-31B's gate|up) where the Q6_K LM head
reaches 2.8 (kquant_ablate.py, docs/performance.md). Gemma's gate|up at one row is 672 blocks with split 1: if a
multiprocessor holds five, the GPU runs 660 at once and the last 12 afterwards, each as long as a whole block's
run. If that tail matters, the time steps up just past each multiple of the resident blocks and the rate falls
there; if the time grows with N smoothly, it does not. The occupancy comes from the driver
(cuOccupancyMaxActiveBlocksPerMultiprocessor on the compiled kernel), the times from CUDA graphs over several
weight copies (L2 cleared before each replay, gguf_run.bench_ms).

    PYTHONPATH=src python scripts/gpu/kquant_waves.py OUT [--only gemma-gate-up,...] [--fractions 0.9,1.0]

Prints, per shape and row count M (1, 16): the blocks a wave holds, then each N with its blocks, waves, us and
TB/s of weight bytes; OUT/kquant_waves.json.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_run import bench_ms, copies_for, random_blocks  # noqa: E402

from flashdraft.kernels.programmatic import _driver  # noqa: E402
from flashdraft.quant import mma_kernels  # noqa: E402
from flashdraft.quant.formats import row_bytes  # noqa: E402

# name -> (type, N, K, tilings for 1-8 and 9-16 rows or None for the adopted ones): the shapes whose products
# stream slowest; and Gemma's gate|up as lane-order Q6_K on the Q6_K LM heads' tilings (the kernel's fastest
# stream, 2.8 TB/s at 510 MB on the H100) and as Q4_K on the same direct-load tilings, which tell whether its
# Q4_K rate is the shape's and grid's or the Q4_K loop's
LM_HEAD_TILINGS = (mma_kernels.MmaTiling(1, 2, 1, 6), mma_kernels.MmaTiling(2, 2, 1, 6))
SHAPES = {
    "gemma-gate-up": ("Q4_K", 43008, 5376, None),
    "gemma-full-qk": ("Q4_K", 18432, 5376, None),
    "gemma-down": ("Q4_K", 5376, 21504, None),
    "qwen-gate-up": ("Q4_K", 24576, 4096, None),
    "qwen-down-q6k": ("Q6_K_LANES", 4096, 12288, None),
    "gemma-gate-up-as-q6k": ("Q6_K_LANES", 43008, 5376, LM_HEAD_TILINGS),
    "gemma-gate-up-direct": ("Q4_K", 43008, 5376, LM_HEAD_TILINGS),
}
# N as fractions of the shape's own (each rounded to the tiling's rows a block)
FRACTIONS = (0.70, 0.80, 0.90, 0.95, 0.98, 1.0, 1.02, 1.05, 1.10, 1.20)


def resident_blocks(kernel, tiling: mma_kernels.MmaTiling, qtype: str, sms: int) -> int:
    """Blocks of this kernel the GPU runs at once: the driver's occupancy for its block size and shared memory,
    times the multiprocessors."""
    occupancy = _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor
    occupancy.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    count = ctypes.c_int()
    status = occupancy(ctypes.byref(count), kernel.func, 32 * tiling.warps, tiling.shared_bytes(qtype))
    if status:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed: {status}")
    return count.value * sms


def row_counts(n: int, rows_per_block: int, resident: int, split: int, fractions=FRACTIONS) -> list[int]:
    """The fractions' N, and N at one and two full waves of the tiling's blocks, sorted."""
    found = {max(rows_per_block, round(n * f / rows_per_block) * rows_per_block) for f in fractions}
    for waves in (1, 2, 3):
        wave_n = waves * resident // split * rows_per_block
        if 0.6 * n <= wave_n <= 1.3 * n:
            found |= {wave_n, wave_n + rows_per_block}
    return sorted(found)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                    help="N as fractions of each shape's own (default: %(default)s)")
    args = ap.parse_args()
    fractions = tuple(float(f) for f in args.fractions.split(","))
    unknown = [name for name in args.only.split(",") if name not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name in args.only.split(","):
        qtype, n_real, k, tilings = SHAPES[name]
        tilings = tilings or mma_kernels.tilings_for(qtype, n_real, k, sms)
        x = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=gen)
        mma_kernels.launch(x[:1], random_blocks(qtype, 16, k, gen, dev), 16, qtype, tilings)  # both builds
        n_max = int(n_real * 1.35)
        ws = [random_blocks(qtype, n_max, k, gen, dev) for _ in range(copies_for(n_real * row_bytes(qtype, k), False))]
        for m, tiling in ((1, tilings[0]), (16, tilings[1])):
            kernel = mma_kernels._matmul_kernel(mma_kernels._code_of(tiling), 1 if m <= 8 else 2, qtype, dev.index or 0)
            resident = resident_blocks(kernel, tiling, qtype, sms)
            per_block = 16 * tiling.r_tiles * tiling.warps
            print(f"{name} M={m} {tiling}: {resident} blocks at once ({resident // sms} a multiprocessor)", flush=True)
            for n in row_counts(n_real, per_block, resident, tiling.split, fractions):
                if n > n_max:
                    continue
                blocks = -(-n // per_block) * tiling.split
                us = 1000 * bench_ms([lambda w=w: mma_kernels.launch(x[:m], w[:n], n, qtype, tiling) for w in ws],
                                     False)
                rate = n * row_bytes(qtype, k) / (us * 1e-6) / 1e12
                rows.append({"shape": name, "qtype": qtype, "k": k, "n": n, "n_real": n_real, "m": m,
                             "tiling": str(tiling), "blocks": blocks, "resident": resident,
                             "waves": blocks / resident, "us": us, "tb_s": rate})
                print(f"  N={n:6d}{'*' if n == n_real else ' '} {blocks:6d} blocks {blocks / resident:5.2f} waves "
                      f"{us:8.2f} us {rate:5.2f} TB/s", flush=True)
        del ws
        torch.cuda.empty_cache()
        (args.out / "kquant_waves.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
