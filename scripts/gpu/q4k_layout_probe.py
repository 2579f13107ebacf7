"""Would Q4_K weights stream faster in another byte order? The same kernel text (kquant_mma.cu) patched to read
the same blocks laid out otherwise, checked to give the original kernel's bits on the original blocks (the same
arithmetic on the same values, at 1, 5 and 16 rows of x), then both timed on the adopted tilings of real shapes at 1
and 16 rows. Probes, not layouts of the package (docs/performance.md, session 41: Gemma-4-31B's Q4_K products
stream at ~2.1 TB/s on the H100 at one row, and so does lane-order Q6_K on the same shape and grid, 2.26, where
copies reach ~3.0).

--layout lanes: each super-block's 128 quant bytes so that lane c's 32 lie together (byte 16 + 32 gq + 8c + b ->
16 + 32c + 8 gq + b), read as two 16-byte loads where the kernel reads four 8-byte ones, from global memory (direct
tilings) or from the shared-memory ring (its rows then 144 bytes apart: the 16-byte reads of a quarter-warp fall on
32 different banks, where the 8-byte layout needed 160), as lane-order Q6_K (q6k_lanes) reads its bytes.
--layout tiles: tile-major, [N / 16 tiles][super-blocks][16 rows][144 bytes]. In GGUF's row-major order a warp's
step reads one 144-byte super-block from each of its tile's rows, rows ~3 KB apart (K = 5376): 16 short pieces a
step, each from another DRAM page; tile-major, a tile's step is one contiguous 2,304-byte run, and its next step the
run after it.
--layout columns: super-block-major, [super-blocks][N][144 bytes]: at a super-block, every warp's tile is the run
after the one before it, so that the GPU's warps, which move through K together, read one stretch of memory in
order (a grid-stride read of the same bytes streams faster than each block reading a run of its own: session 42,
read_stream_probe.py). The package's kernel reads it itself (Q4_K_COLUMNS) with its chunk of rows set to N.
--layout chunks: the package's Q4_K_COLUMNS (flashdraft.quant.q4k_columns): super-block-major in chunks of 256 rows,
so that fused projections and their parts stay views of one another.
(The ring filled by the copy engine, which session 42 probed here on tile-major lane-order blocks, is a tiling
choice of the kernel itself since session 49: MmaTiling.bulk, timed by mma_tilings.py --copy-engine.)

    PYTHONPATH=src python scripts/gpu/q4k_layout_probe.py OUT --layout lanes|tiles|columns|chunks
        [--only gemma-q4k-fused,...] [--stages 4,6]

--only: mma_tilings.py's Q4_K shape sets (default gemma-q4k-fused, gemma-q4k, qwen-q4k-fused).
OUT/q4k_LAYOUT.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_run import bench_ms, copies_for, random_blocks  # noqa: E402
from kquant_ablate import apply_patches  # noqa: E402
from mma_tilings import SETS  # noqa: E402

from flashdraft.quant import mma_kernels, q4k_columns  # noqa: E402
from flashdraft.quant.formats import row_bytes  # noqa: E402

QS = 16  # where a Q4_K super-block's quant bytes start
TILE_ROWS = 16
LANE_LOADS = ("{{ const uint4 a = {load}(blk + QS + 32 * c)), b = {load}(blk + QS + 32 * c + 16));"
              " q[r][hh][0] = make_uint2(a.x, a.y); q[r][hh][1] = make_uint2(a.z, a.w);"
              " q[r][hh][2] = make_uint2(b.x, b.y); q[r][hh][3] = make_uint2(b.z, b.w); }}")
ROW_PREFETCH = ("    for (int i = lane; i < R_TILES * 16 && prefetch_sb > 0; i += 32)  // a lane a row, while earlier "
                "kernels run\n        prefetch_l2(W + (size_t)min(tile0 * 16 + i, N - 1) * row_stride(nsb) + "
                "(size_t)sb0 * BLOCK_BYTES,\n                    (size_t)prefetch_sb * BLOCK_BYTES);")


# the kernel's row_offset (GGUF's order, COLUMNS 0: the patched kernels are built as Q4_K) and sb_offset
ROW_OFFSET = "#else\n    return (size_t)row * row_stride(nsb);"
SB_OFFSET = "    return (size_t)sb * (COLUMNS ? CHUNK_ROWS : 1) * BLOCK_BYTES;"


def reordered(prefetch: str, row_at, sb_stride: str) -> list[tuple[str, str, int]]:
    """The patches that make the kernel find a row's first super-block at W + row_at(row) (a C expression of the
    row) and step through its super-blocks sb_stride bytes apart (the kernel's row_offset and sb_offset), with
    `prefetch` as its L2 prefetch."""
    return [(ROW_PREFETCH, prefetch, 1), (ROW_OFFSET, f"#else\n    return {row_at('row')};", 1),
            (SB_OFFSET, f"    return (size_t)sb * {sb_stride};", 1)]


# layout -> (old text, new text, times it occurs in kquant_mma.cu) patches
PATCHES = {
    # the quant loads of the direct and the ring loops, and the ring's row pitch
    "lanes": [
        ("for (int gq = 0; gq < 4; ++gq) q[r][hh][gq] = __ldg((const uint2 *)(blk + QS + 32 * gq + 8 * c));",
         LANE_LOADS.format(load="__ldg((const uint4 *)"), 1),
        ("for (int gq = 0; gq < 4; ++gq) q[r][hh][gq] = *(const uint2 *)(blk + QS + 32 * gq + 8 * c);",
         LANE_LOADS.format(load="*((const uint4 *)"), 1),
        ("#define ROWB (RING_BULK ? BLOCK_BYTES : QTYPE == 4 ? 160 : 224)",
         "#define ROWB (RING_BULK ? BLOCK_BYTES : QTYPE == 4 ? 144 : 224)", 1),
    ],
    # every address of a row's super-block: its tile's run, its place in the tile, 16 blocks a step; the L2
    # prefetch a tile's run per lane
    "tiles": reordered(
        "    for (int i = lane; i < R_TILES && prefetch_sb > 0 && (tile0 + i) * 16 < N; i += 32)  // a lane a tile\n"
        "        prefetch_l2(W + tile_base((tile0 + i) * 16, nsb) + (size_t)sb0 * 16 * BLOCK_BYTES,\n"
        "                    (size_t)prefetch_sb * 16 * BLOCK_BYTES);",
        lambda row: f"tile_base({row}, nsb)", "16 * BLOCK_BYTES"),
}
TILE_HELPER = """
// byte offset of a row's first super-block in the tile-major layout: its tile's run, then its place in the tile
__device__ __forceinline__ size_t tile_base(int row, int nsb) {
    return (size_t)(row / 16) * 16 * row_stride(nsb) + (size_t)(row % 16) * BLOCK_BYTES;
}
"""
ANCHOR = "// Where Q4_K / Q5_K weight row `row`'s super-block sb starts"



def insert_before(source: str, anchor: str, text: str) -> str:
    if source.count(anchor) != 1:
        raise ValueError(f"the kernel has no single {anchor!r} to put helpers before")
    return source.replace(anchor, text + anchor)


def layout_source(layout: str, source: str) -> str:
    """kquant_mma.cu's text reading the blocks in `layout` (ValueError where a patch does not fit the text)."""
    source = apply_patches(source, PATCHES[layout], layout)
    if layout == "tiles":
        source = insert_before(source, ANCHOR, TILE_HELPER)
    return source


# layouts the package's kernel reads itself (Q4_K_COLUMNS), by their chunk of rows (None: the weight's N)
NATIVE = {"columns": None, "chunks": q4k_columns.CHUNK_ROWS}


def native_source(layout: str, n: int) -> str:
    """kquant_mma.cu with the chunk of rows of a NATIVE layout for an n-row weight."""
    return f"#undef CHUNK_ROWS\n#define CHUNK_ROWS {NATIVE[layout] or n}\n" + mma_kernels.SOURCE.read_text()


def to_layout(layout: str, blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K rows [N, nsb * 144] -> the same bytes in `layout`, as a [N, nsb * 144] tensor."""
    n, nbytes = blocks.shape
    nsb = nbytes // 144
    if layout == "columns":  # [N][nsb][144] -> [nsb][N][144]
        return blocks.reshape(n, nsb, 144).transpose(0, 1).contiguous().reshape(n, nbytes)
    if layout == "chunks":
        return q4k_columns.from_rows(blocks)
    if layout == "lanes":  # each super-block's quant bytes (gq, c, b) -> (c, gq, b)
        b = blocks.reshape(n, nsb, 144)
        quants = b[..., QS:].reshape(n, nsb, 4, 4, 8).transpose(2, 3).reshape(n, nsb, 128)
        return torch.cat([b[..., :QS], quants], dim=-1).reshape(n, nbytes).contiguous()
    return blocks.reshape(n // TILE_ROWS, TILE_ROWS, nsb, 144).transpose(1, 2).reshape(n, nbytes).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layout", choices=sorted(PATCHES) + sorted(NATIVE), required=True)
    ap.add_argument("--only", default="gemma-q4k-fused,gemma-q4k,qwen-q4k-fused")
    ap.add_argument("--stages", default="", help="also the layout with rings of these many stages (e.g. 4,6) where "
                    "a tiling has a ring: where loads wait, so the same bits")
    args = ap.parse_args()
    wrong = [name for name in args.only.split(",") if SETS.get(name, ("",))[0] != "Q4_K"]
    if wrong:
        ap.error(f"not Q4_K shape sets of mma_tilings.py: {wrong}")
    args.out.mkdir(parents=True, exist_ok=True)
    native = args.layout in NATIVE
    qtype = q4k_columns.QTYPE if native else "Q4_K"
    patched = None if native else layout_source(args.layout, mma_kernels.SOURCE.read_text())
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for set_name in args.only.split(","):
        for shape, (n, k) in SETS[set_name][1].items():
            tilings = mma_kernels.tilings_for("Q4_K", n, k)
            ws = [random_blocks("Q4_K", n, k, gen, dev) for _ in range(copies_for(n * row_bytes("Q4_K", k), False))]
            ls = [to_layout(args.layout, w) for w in ws]
            x = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=gen)
            source = native_source(args.layout, n) if native else patched
            forms = [("gguf", ws, None, tilings), (args.layout, ls, source, tilings)]
            for stages in filter(None, args.stages.split(",")):
                forms.append((f"{args.layout}-s{stages}", ls, source,
                              tuple(dataclasses.replace(t, stages=int(stages)) if t.stages else t
                                    for t in tilings)))
            want = {m: mma_kernels.launch(x[:m], ws[0], n, "Q4_K", tilings) for m in (1, 5, 16)}
            same = {form: all(torch.equal(want[m], mma_kernels.launch(x[:m], blocks[0], n, qtype, form_tilings,
                                                                      source=text)) for m in want)
                    for form, blocks, text, form_tilings in forms[1:]}
            us = {}
            for form, blocks, text, form_tilings in forms:
                q = "Q4_K" if form == "gguf" else qtype
                us[form] = [1000 * bench_ms([lambda w=w, m=m, t=form_tilings, s=text, q=q: mma_kernels.launch(
                    x[:m], w, n, q, t, source=s) for w in blocks], False) for m in (1, 16)]
            mb = n * row_bytes("Q4_K", k) / 1e6
            old = us["gguf"]
            rows.append({"set": set_name, "shape": shape, "n": n, "k": k, "mb": mb, "same_bits": same,
                         "tilings": [str(t) for t in tilings], **{f"us_{form}": v for form, v in us.items()}})
            for form, new in us.items():
                if form != "gguf":
                    print(f"{set_name} {shape:12s} {n}x{k} ({mb:6.1f} MB) {form} same bits {same[form]}: M=1 "
                          f"{old[0]:7.2f} -> {new[0]:7.2f} us ({mb / old[0]:.2f} -> {mb / new[0]:.2f} TB/s), M=16 "
                          f"{old[1]:7.2f} -> {new[1]:7.2f} us", flush=True)
            del ws, ls
            torch.cuda.empty_cache()
            (args.out / f"q4k_{args.layout}.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
