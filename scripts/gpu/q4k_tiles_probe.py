"""Would Q4_K weights stream faster tile by tile? In GGUF's row-major order a warp's step reads one 144-byte
super-block from each of its 16-row tile's rows, rows ~3 KB apart (K = 5376): 16 short pieces a step, each from
another DRAM page. Here the same kernel text reads blocks laid out tile-major, [N / 16 tiles][super-blocks][16
rows][144 bytes], so a tile's step is one contiguous 2,304-byte run, and its next step the run after it. A probe,
not a layout of the package: the results must be the original kernel's bits on the original blocks (the same
arithmetic on the same values), then both are timed on the adopted tilings of real shapes at 1 and 16 rows of x.

The question it answers (docs/performance.md, session 41): Gemma-4-31B's Q4_K products stream at ~2.1 TB/s on the
H100 at one row, and so does lane-order Q6_K on the same shape and grid (2.26 TB/s), where copies reach ~3.0: is
that the DRAM access pattern of many short pieces?

    PYTHONPATH=src python scripts/gpu/q4k_tiles_probe.py OUT [--only gemma-q4k-fused,...]

--only: mma_tilings.py's Q4_K shape sets (default gemma-q4k-fused, gemma-q4k, qwen-q4k-fused). OUT/q4k_tiles.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_run import bench_ms, copies_for, random_blocks  # noqa: E402
from mma_tilings import SETS  # noqa: E402

from flashdraft.quant import mma_kernels  # noqa: E402
from flashdraft.quant.formats import row_bytes  # noqa: E402

TILE_ROWS = 16
HELPER = """
// byte offset of a row's first super-block in the tile-major layout: its tile's run, then its place in the tile
__device__ __forceinline__ size_t tile_base(int row, int nsb) {
    return (size_t)(row / 16) * 16 * row_stride(nsb) + (size_t)(row % 16) * BLOCK_BYTES;
}
"""
ANCHOR = "// The warp's sums at zero, and where this lane reads x"
# (old text, new text, times it occurs in kquant_mma.cu)
PATCHES = [
    ("    for (int i = lane; i < R_TILES * 16 && prefetch_sb > 0; i += 32)  // a lane a row, while earlier kernels "
     "run\n        prefetch_l2(W + (size_t)min(tile0 * 16 + i, N - 1) * row_stride(nsb) + (size_t)sb0 * BLOCK_BYTES,"
     "\n                    (size_t)prefetch_sb * BLOCK_BYTES);",
     "    for (int i = lane; i < R_TILES && prefetch_sb > 0 && (tile0 + i) * 16 < N; i += 32)  // a lane a tile\n"
     "        prefetch_l2(W + tile_base((tile0 + i) * 16, nsb) + (size_t)sb0 * 16 * BLOCK_BYTES,\n"
     "                    (size_t)prefetch_sb * 16 * BLOCK_BYTES);", 1),
    ("rowp[r][hh] = W + (size_t)min((tile0 + r) * 16 + g + 8 * hh, N - 1) * row_stride(nsb);",
     "rowp[r][hh] = W + tile_base(min((tile0 + r) * 16 + g + 8 * hh, N - 1), nsb);", 2),
    ("const unsigned char *blk = rowp[r][hh] + sb * BLOCK_BYTES;",
     "const unsigned char *blk = rowp[r][hh] + (size_t)sb * 16 * BLOCK_BYTES;", 1),
    ("csrc[t] = W + (size_t)min(tile0 * 16 + (con[t] ? row : 0), N - 1) * row_stride(nsb) + 16 * col;",
     "csrc[t] = W + tile_base(min(tile0 * 16 + (con[t] ? row : 0), N - 1), nsb) + 16 * col;", 1),
    ("csrc[t] + (size_t)(sb0 + s) * BLOCK_BYTES", "csrc[t] + (size_t)(sb0 + s) * 16 * BLOCK_BYTES", 1),
    ("csrc[t] + (size_t)ahead * BLOCK_BYTES", "csrc[t] + (size_t)ahead * 16 * BLOCK_BYTES", 1),
]


def tiles_source(source: str) -> str:
    for old, new, times in PATCHES:
        if source.count(old) != times:
            raise ValueError(f"{old[:60]!r}... occurs {source.count(old)} times in the kernel, not {times}")
        source = source.replace(old, new)
    if source.count(ANCHOR) != 1:
        raise ValueError(f"the kernel has no single {ANCHOR!r} to put the helper before")
    return source.replace(ANCHOR, HELPER + ANCHOR)


def to_tiles(blocks: torch.Tensor, block_bytes: int = 144) -> torch.Tensor:
    """Rows [N, nsb * 144] -> the same bytes tile-major, [N / 16][nsb][16][144], as a [N, nsb * 144] tensor."""
    n, nbytes = blocks.shape
    nsb = nbytes // block_bytes
    return blocks.reshape(n // TILE_ROWS, TILE_ROWS, nsb, block_bytes).transpose(1, 2).reshape(n, nbytes).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default="gemma-q4k-fused,gemma-q4k,qwen-q4k-fused")
    args = ap.parse_args()
    wrong = [name for name in args.only.split(",") if SETS.get(name, ("",))[0] != "Q4_K"]
    if wrong:
        ap.error(f"not Q4_K shape sets of mma_tilings.py: {wrong}")
    args.out.mkdir(parents=True, exist_ok=True)
    tiled = tiles_source(mma_kernels.SOURCE.read_text())
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for set_name in args.only.split(","):
        for shape, (n, k) in SETS[set_name][1].items():
            tilings = mma_kernels.tilings_for("Q4_K", n, k)
            ws = [random_blocks("Q4_K", n, k, gen, dev) for _ in range(copies_for(n * row_bytes("Q4_K", k), False))]
            ts = [to_tiles(w) for w in ws]
            x = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=gen)
            same = all(torch.equal(mma_kernels.launch(x[:m], ws[0], n, "Q4_K", tilings),
                                   mma_kernels.launch(x[:m], ts[0], n, "Q4_K", tilings, source=tiled))
                       for m in (1, 5, 16))
            us = {}
            for form, blocks, source in (("rows", ws, None), ("tiles", ts, tiled)):
                us[form] = [1000 * bench_ms([lambda w=w, m=m: mma_kernels.launch(x[:m], w, n, "Q4_K", tilings,
                                                                                 source=source) for w in blocks],
                                            False) for m in (1, 16)]
            mb = n * row_bytes("Q4_K", k) / 1e6
            rows.append({"set": set_name, "shape": shape, "n": n, "k": k, "mb": mb, "same_bits": same,
                         "tilings": [str(t) for t in tilings], "us_rows": us["rows"], "us_tiles": us["tiles"]})
            print(f"{set_name} {shape:12s} {n}x{k} ({mb:6.1f} MB) same bits {same}: M=1 {us['rows'][0]:7.2f} -> "
                  f"{us['tiles'][0]:7.2f} us ({mb / us['rows'][0]:.2f} -> {mb / us['tiles'][0]:.2f} TB/s), "
                  f"M=16 {us['rows'][1]:7.2f} -> {us['tiles'][1]:7.2f} us", flush=True)
            del ws, ts
            torch.cuda.empty_cache()
            (args.out / "q4k_tiles.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                 "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
