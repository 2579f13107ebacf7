"""Where the k-quant kernel's time goes, by leaving one stage out: kquant_mma.cu with a part of its arithmetic
removed (the results are then wrong: only timed), against the kernel as it is, at 1 and 16 rows of x, on the
adopted tilings of real shapes (issue #18: the 16-row build costs ~1.56x the one-row one for the same bytes, and
DFlash's verify runs it; Gemma's one-row products stream at ~60% of the copy bandwidth). The differences bound what
removing or moving each stage could give. No hardware counters needed (H200.md: time variants that leave one
stage out and take differences).

Variants (text patches of the kernel; each must apply exactly as many times as listed, or the script stops):
- "x sums": the ones-MMAs that sum x over each 32- (Q6_K: 16-) weight group, which every warp recomputes for the
  same x;
- "group scales": the per-group scale-and-add of each MMA's sums (an add instead);
- "super-block correction" (Q4_K / Q5_K): the MMAs that subtract the minimums' and the 128 offset's terms, and
  the transposes feeding them;
- "weight MMAs": the tensor-core products of the weights (their A fragments folded into the sums by XOR instead,
  so the loads and byte permutes stay);
- "all arithmetic": the four above at once: the loads, permutes and stores alone, the kernel's streaming;
- "x loaded once": x's fragments read from one place for every super-block, so loaded before the loop (what the
  per-super-block loads of x, L1 or L2 hits, cost);
- "ring unwaited" (tilings whose ring the lanes fill): no wait for a stage's copies (the time of the loop's issue
  or of the copies' stream, whichever is longer, without the waits between them); a tiling that loads directly
  (the 16-row ones, mostly) or whose ring the copy engine fills runs as is;
- "weights through L1" (tilings whose ring the lanes fill): the weights' copies into it as cp.async.ca instead of
  .cg (the same results); other tilings run as is;
- "x a super-block ahead": in the builds for up to 8 rows, x's fragments for the next super-block loaded while
  this one is computed (registers instead of a wait on x's loads, the long scoreboard being the profiles' first
  stall; the same results; the 16-row builds run as is);
- "x in shared memory": in the builds for up to 8 rows, x's K range copied by the block into shared memory once,
  where one row of it fits (so at one row only), and read from there;
- "x into L1 1 ahead", "x into L1 2 ahead": the lines of x a later super-block reads prefetched into L1 (no data
  held in registers);
- "x in the copy engine's ring" (tilings whose ring the copy engine fills, at one row): x's 512 bytes of each
  super-block copied into the ring with its weights. These eight touch only the Q4_K / Q5_K part, and Q6_K shapes
  skip them;
- "launch only": every block returns at once (the grid launched gridDim.z = 1): the launch and scheduling of the
  same grid, with its shared memory and registers. With "as is", the three split a product's time into its
  launch, its weights' stream and its arithmetic, which is what a fixed cost of ~5 us a launch (issue #18:
  fitted over shapes, docs/performance.md) is made of.
A variant also changes the registers (offline, nvcc 13, sm_90, Q4_K at 1 tile and 2 token tiles: 182 as is, 156
without the x sums, 144 without the correction; "x a super-block ahead" takes 20-36 more in the builds for up to 8
rows), so where a tiling's min_blocks does not cap them, a difference includes a change in the warps resident:
each line says the registers and blocks a multiprocessor of the builds it timed (libcuda's counts).

The variants that keep the results (SAME_BITS) are checked against the kernel as is, at 1, 5, 8 and 16 rows.

Usage (GPU machine, repo root):
    PYTHONPATH=src python scripts/gpu/kquant_ablate.py OUT [--only qwen-q4k-fused,qwen-q6k,...]
        [--variants "x sums,weights through L1"] [--gguf-order] [--budget-s S]
--only: mma_tilings.py's shape sets (default: qwen-q4k-fused, qwen-q6k, gemma-q4k-fused); --variants: the variants
to time beside "as is" (default all); Q4_K weights whose rows fill the package's chunks are timed as the loader
keeps them (Q4_K_COLUMNS, with its tilings: the copy engine's rings among them), unless --gguf-order.
OUT/kquant_ablate.json gets every time.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_run import as_loaded, bench_ms, copies_for, random_blocks  # noqa: E402
from mma_tilings import SETS  # noqa: E402

from flashdraft.quant import mma_kernels, q4k_columns  # noqa: E402
from flashdraft.quant.formats import row_bytes  # noqa: E402

HELPERS = """
#define X_SHARED_ELEMS 5376  // "x in shared memory": one row of Gemma's widest K range
__device__ __forceinline__ void skip_mma(float (&d)[4], u32, u32, u32, u32, u32, u32) {}
__device__ __forceinline__ void xor_mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    d[0] = __uint_as_float(__float_as_uint(d[0]) ^ a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1);
}
__device__ __forceinline__ void skip_mma_c(float (&d)[4], u32, u32, u32, u32, u32, u32, const float (&c)[4]) {
    for (int i = 0; i < 4; ++i) d[i] = c[i];
}
__device__ __forceinline__ void xor_mma_c(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1,
                                          const float (&c)[4]) {
    for (int i = 0; i < 4; ++i) d[i] = c[i];
    xor_mma(d, a0, a1, a2, a3, b0, b1);
}
#ifdef NT
// the x fragments a Q4_K / Q5_K super-block's loop reads (its xv loads), for super-block sb
__device__ __forceinline__ void x_of_super_block(uint4 (&xs)[4][NT][2], const u16 *const (&xrow)[NT],
                                                 const bool (&xok)[NT], int sb) {
#pragma unroll
    for (int gq = 0; gq < 4; ++gq)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                xs[gq][nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + 256 * sb + 32 * (2 * gq + h)))
                                        : make_uint4(0, 0, 0, 0);
}
#endif
"""
# variant -> (old text, new text, times it occurs in kquant_mma.cu)
VARIANTS = {
    "as is": [],
    "x sums": [("mma_bf16_16816(ones,", "skip_mma(ones,", 1),
               ("mma_bf16_16816_c(offs[nt],", "skip_mma_c(offs[nt],", 1)],
    "group scales": [("tot[r][nt][i] = fmaf(acc[nt][i], dl[i >> 1], tot[r][nt][i]);",
                      "tot[r][nt][i] += acc[nt][i];", 1),
                     ("tot[r][nt][i] = fmaf(dl[i >> 1], acc[i], tot[r][nt][i]);", "tot[r][nt][i] += acc[i];", 1)],
    "super-block correction": [("mma_bf16_16816(cm,", "skip_mma(cm,", 2), ("mma_bf16_16816(cs,", "skip_mma(cs,", 2),
                               ("xs3[nt][part] = transpose8x8(xs3[nt][part]);", ";", 1)],
    "weight MMAs": [("mma_bf16_16816(acc[nt],", "xor_mma(acc[nt],", 1),
                    ("mma_bf16_16816_c(acc, ", "xor_mma_c(acc, ", 1)],
}
# every arithmetic stage out at once: what is left is the kernel's loads, byte permutes and stores
VARIANTS["all arithmetic"] = [patch for name in ("x sums", "group scales", "super-block correction", "weight MMAs")
                              for patch in VARIANTS[name]]
# x's loads for a super-block at a fixed place (loop-invariant, so loaded once): what the kernel's per-super-block
# loads of x (from L1 / L2) cost it
VARIANTS["x loaded once"] = [("xrow[nt] + sb * 256 + 32 * (2 * gq + h)", "xrow[nt] + 32 * (2 * gq + h)", 1)]
# the ring's copies never waited for (Q4_K / Q5_K tilings with a ring): a super-block is computed from whatever the
# stage holds, while the copies stream on; the time is then the larger of the loop's issue and the copies' stream,
# where as is it also has every wait for a stage
VARIANTS["ring unwaited"] = [("cp_async_wait_ahead();", ";", 1)]
# the ring's weight copies through L1 (cp.async.ca instead of .cg; the same results): the kernel's ring alone filled
# so streamed 10% faster on an H100 (read_stream_probe.py --kinds ring, docs/performance.md, session 48)
VARIANTS["weights through L1"] = [("@p cp.async.cg.shared.global", "@p cp.async.ca.shared.global", 1)]
# x's fragments for super-block sb + 1 loaded into registers while sb is computed, in the builds for up to 8 rows
# (20-36 more registers offline; the 16-row builds would spill): the one-row products' first stall on an H100 is
# the long scoreboard (docs/performance.md, session 50)
VARIANTS["x a super-block ahead"] = [
    ("    wait_for_earlier_kernels();\n    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {\n"
     "        uint4 hdr[R_TILES][2];",
     "    wait_for_earlier_kernels();\n#if NT == 1\n    uint4 xnext[4][NT][2];\n"
     "    x_of_super_block(xnext, xrow, xok, sb0);\n#endif\n"
     "    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {\n#if NT == 1\n"
     "        uint4 xcur[4][NT][2];\n"
     "#pragma unroll\n        for (int i = 0; i < 4 * NT * 2; ++i) (&xcur[0][0][0])[i] = (&xnext[0][0][0])[i];\n"
     "        if (sb + 1 < sb0 + sb_per_split) x_of_super_block(xnext, xrow, xok, sb + 1);\n#endif\n"
     "        uint4 hdr[R_TILES][2];", 1),
    ("                    xv[nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + sb * 256 + 32 * (2 * gq + h)))\n"
     "                                        : make_uint4(0, 0, 0, 0);",
     "#if NT == 1\n                    xv[nt][h] = xcur[gq][nt][h];\n#else\n"
     "                    xv[nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + sb * 256 + 32 * (2 * gq + h)))\n"
     "                                        : make_uint4(0, 0, 0, 0);\n#endif", 1)]
# x's K range copied by the block into shared memory once, after the wait for earlier kernels, where M rows of it
# fit (X_SHARED_ELEMS, in HELPERS: one row of Gemma's widest range, so one-row products only; a block-uniform
# choice), by the block's warps that have rows (those past N returned at the kernel's start), and read from there in
# the loop through the generic address space. A branch in the loop between a shared and a global load kept the
# compiler from hoisting them (offline, the 16-row build of 1 tile, 2 warps and 6 stages went from 182 registers
# to 133), so the builds for up to 8 rows read every x so, and the 16-row builds run as is. Loads of a few cycles
# where the profiles' first stall is the long scoreboard: the bound "x loaded once" sets, without its wrong results
# (a product in the package would size the array by M)
VARIANTS["x in shared memory"] = [
    ("    wait_for_earlier_kernels();\n    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {\n"
     "        uint4 hdr[R_TILES][2];",
     "    wait_for_earlier_kernels();\n"
     "#if NT == 1\n"
     "    __shared__ __align__(16) u16 x_shared[X_SHARED_ELEMS];\n"
     "    const int x_range = sb_per_split * 256;\n"
     "    if (M * x_range <= X_SHARED_ELEMS) {  // the same for every thread of the block\n"
     "        const int tiles_left = (N / 16 - blockIdx.x * WARPS * R_TILES + R_TILES - 1) / R_TILES;\n"
     "        const int live = 32 * min(WARPS, tiles_left);  // the threads of the warps that did not return\n"
     "        for (int i = threadIdx.x; i < M * x_range / 8; i += live) {\n"
     "            const int t = i / (x_range / 8), e = 8 * (i % (x_range / 8));\n"
     "            *(uint4 *)(x_shared + t * x_range + e) = __ldg((const uint4 *)(X + (size_t)t * K + sb0 * 256 + e));\n"
     "        }\n"
     "        __syncthreads();\n"
     "#pragma unroll\n"
     "        for (int nt = 0; nt < NT; ++nt)\n"
     "            xrow[nt] = x_shared + (xok[nt] ? g + 8 * nt : 0) * x_range - sb0 * 256 + 8 * c;\n"
     "    }\n"
     "#endif\n"
     "    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {\n"
     "        uint4 hdr[R_TILES][2];", 1),
    ("                    xv[nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + sb * 256 + 32 * (2 * gq + h)))\n",
     "#if NT == 1\n"
     "                    xv[nt][h] = xok[nt] ? *(const uint4 *)(xrow[nt] + sb * 256 + 32 * (2 * gq + h))\n"
     "#else\n"
     "                    xv[nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + sb * 256 + 32 * (2 * gq + h)))\n"
     "#endif\n", 1)]
# the 128-byte lines of x a later super-block's loop reads prefetched into L1 at the top of each super-block (lane c
# of a token's four takes line c of its 512 bytes; no data held in registers): the warps of a multiprocessor reach each
# super-block together, so its x is new to L1 for all of them, and the profile's first stall (on an H100, session
# 51) is the loop's first weight MMA waiting on x's load. (x's rows start on 128-byte lines where torch allocated
# them, as in the step; launch() promises only 16 bytes, and off a line the four prefetches miss a fifth line.)
for ahead in (1, 2):
    VARIANTS[f"x into L1 {ahead} ahead"] = [
        ("        uint4 hdr[R_TILES][2];\n",
         f"        if (sb + {ahead} < sb0 + sb_per_split)\n"
         "#pragma unroll\n"
         "            for (int nt = 0; nt < NT; ++nt)\n"
         "                if (xok[nt])\n"
         "                    asm volatile(\"prefetch.global.L1 [%0];\" :: "
         f"\"l\"(xrow[nt] - 8 * c + (sb + {ahead}) * 256 + 64 * c));\n"
         "        uint4 hdr[R_TILES][2];\n", 1)]
# x's row for a super-block (512 bytes, where M is 1) copied into the copy engine's ring with the weights by the
# kernel's own bulk_copy, and read from there (generic loads; the builds without that ring run as is). Each stage's
# mbarrier then waits for two arrivals, the weights' and x's: the stages filled before griddepcontrol.wait get x's
# copy (the earlier kernel's output) after it, so no stage completes without them. No data held in registers, where
# "x a super-block ahead" holds 20-36
VARIANTS["x in the copy engine's ring"] = [
    ("    const unsigned char *run = W + row_offset(tile0 * 16, nsb);\n",
     "    const unsigned char *run = W + row_offset(tile0 * 16, nsb);\n"
     "    __shared__ __align__(128) u16 x_ring[WARPS][STAGES][256];  // x's row at a stage's super-block (M 1)\n"
     "    const u32 x_ring_addr = shared_window(&x_ring[warp][0][0]);\n"
     "    const bool x_in_ring = M == 1;\n", 1),
    ('            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full_addr + 8 * s) : "memory");',
     '            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(full_addr + 8 * s),\n'
     '                         "r"(x_in_ring ? 2 : 1) : "memory");', 1),
    ("    wait_for_earlier_kernels();\n    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {\n"
     "        uint4 hdr[R_TILES][2];",
     "    wait_for_earlier_kernels();\n#if RING_BULK\n"
     "    if (lane == 0 && x_in_ring)\n"
     "        for (int s = 0; s < STAGES - 1 && sb0 + s < sb_end; ++s)\n"
     "            bulk_copy(x_ring_addr + 512 * s, X + (size_t)(sb0 + s) * 256, 512, full_addr + 8 * s);\n#endif\n"
     "    for (int sb = sb0; sb < sb0 + sb_per_split; ++sb) {\n        uint4 hdr[R_TILES][2];", 1),
    ("            bulk_copy(ring_addr + slot * STAGE_BYTES, run + sb_offset(ahead), STAGE_BYTES, "
     "full_addr + 8 * slot);",
     "            bulk_copy(ring_addr + slot * STAGE_BYTES, run + sb_offset(ahead), STAGE_BYTES, "
     "full_addr + 8 * slot);\n"
     "            if (x_in_ring) bulk_copy(x_ring_addr + 512 * slot, X + (size_t)ahead * 256, 512, "
     "full_addr + 8 * slot);", 1),
    ("        float xsum[NT][4];\n",
     "        const u16 *xsb[NT];  // x at this super-block: X's rows, or the ring's copy of row 0\n"
     "#pragma unroll\n        for (int nt = 0; nt < NT; ++nt) xsb[nt] = xrow[nt] + sb * 256;\n"
     "#if RING_BULK\n        if (x_in_ring) xsb[0] = &x_ring[warp][(sb - sb0) % STAGES][8 * c];\n#endif\n"
     "        float xsum[NT][4];\n", 1),
    ("                    xv[nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + sb * 256 + 32 * (2 * gq + h)))\n",
     "#if RING_BULK\n"
     "                    xv[nt][h] = xok[nt] ? *(const uint4 *)(xsb[nt] + 32 * (2 * gq + h))\n#else\n"
     "                    xv[nt][h] = xok[nt] ? __ldg((const uint4 *)(xrow[nt] + sb * 256 + 32 * (2 * gq + h)))\n"
     "#endif\n", 1)]
# the variants whose patches touch only the Q4_K / Q5_K part of the kernel: for Q6_K they would time the kernel as is
Q45_ONLY = {"x loaded once", "ring unwaited", "weights through L1", "x a super-block ahead", "x in shared memory",
            "x into L1 1 ahead", "x into L1 2 ahead", "x in the copy engine's ring"}
# the variants that change where bytes come from, not the results: checked against the kernel as is
SAME_BITS = {"weights through L1", "x a super-block ahead", "x in shared memory", "x into L1 1 ahead",
             "x into L1 2 ahead", "x in the copy engine's ring"}
# every block returns at once: the launch and scheduling of the same grid, its shared memory and registers
VARIANTS["launch only"] = [("if (tile0 * 16 >= N) return;", "if (tile0 * 16 >= N || gridDim.z == 1) return;", 1)]
DEFAULT_SETS = "qwen-q4k-fused,qwen-q6k,gemma-q4k-fused"


def apply_patches(source: str, patches, what: str) -> str:
    """source with each (old text, new text, times it occurs) patch applied; ValueError naming `what` where a
    patch does not fit the text (the kernel changed under it)."""
    for old, new, times in patches:
        if source.count(old) != times:
            raise ValueError(f"{what}: {old!r} occurs {source.count(old)} times in the kernel, not {times}")
        source = source.replace(old, new)
    return source


def applies(name: str, qtype: str) -> bool:
    """Whether variant `name` changes the kernel that multiplies qtype blocks (else it would time it as is)."""
    return name not in Q45_ONLY or qtype in ("Q4_K", "Q5_K")


def variant_source(name: str, source: str) -> str:
    """kquant_mma.cu's text with variant `name` applied (ValueError where a patch does not fit the text)."""
    source = apply_patches(source, VARIANTS[name], f"variant {name!r}")
    anchor = "typedef unsigned short u16;\n"
    if source.count(anchor) != 1:
        raise ValueError(f"the kernel has no single {anchor.strip()!r} to put the variants' helpers after")
    return source.replace(anchor, anchor + HELPERS)


def residency(qtype: str, tiling: mma_kernels.MmaTiling, nt: int, source: str) -> dict:
    """The registers a thread of this build takes and the blocks of it a multiprocessor holds (libcuda's own
    count, with the tiling's shared memory): what a variant changes besides its instructions. RuntimeError naming
    the call where libcuda answers with an error."""
    kernel = mma_kernels._matmul_kernel(mma_kernels._code_of(tiling), nt, qtype, torch.cuda.current_device(), source)
    lib, regs, blocks = ctypes.CDLL("libcuda.so.1"), ctypes.c_int(), ctypes.c_int()
    for name, status in (
            ("cuFuncGetAttribute", lib.cuFuncGetAttribute(ctypes.byref(regs), 4, kernel.func)),  # NUM_REGS
            ("cuOccupancyMaxActiveBlocksPerMultiprocessor",
             lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), kernel.func, 32 * tiling.warps,
                                                             ctypes.c_size_t(tiling.shared_bytes(qtype))))):
        if status:
            raise RuntimeError(f"{name} returned CUresult {status}")
    return {"registers": regs.value, "blocks_per_sm": blocks.value}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default=DEFAULT_SETS, help="comma-separated shape sets of mma_tilings.py")
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "as is"),
                    help="comma-separated variants timed beside 'as is'")
    ap.add_argument("--gguf-order", action="store_true", help="Q4_K in GGUF's row order, not the package's layout")
    ap.add_argument("--budget-s", type=float, default=float("inf"))
    args = ap.parse_args()
    unknown = [name for name in args.only.split(",") if name not in SETS]
    if unknown:
        ap.error(f"unknown shape sets {unknown}; choose from {', '.join(SETS)}")
    chosen = ["as is"] + [v for v in args.variants.split(",") if v and v != "as is"]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    text = mma_kernels.SOURCE.read_text()
    sources = {name: variant_source(name, text) for name in chosen}  # every patch checked before any GPU work
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, t0 = [], time.time()
    todo = [(set_name, shape, n, k) for set_name in args.only.split(",")
            for shape, (n, k) in SETS[set_name][1].items()]
    for i, (set_name, shape, n, k) in enumerate(todo):
        qtype = SETS[set_name][0]
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: {len(todo) - i} shapes not measured, from {set_name} {shape} on", flush=True)
            break
        ws = [random_blocks(qtype, n, k, gen, dev)
              for _ in range(copies_for(n * row_bytes(qtype, k), False))]
        ws, qtype = as_loaded(qtype, ws, args.gguf_order)
        tilings = mma_kernels.tilings_for(qtype, n, k)
        x = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=gen)
        want = ({m: mma_kernels.launch(x[:m], ws[0], n, qtype, tilings) for m in (1, 5, 8, 16)}
                if SAME_BITS & set(sources) else {})
        base = None
        for name, source in sources.items():
            if not applies(name, q4k_columns.file_type(qtype)):
                continue
            same = None
            if name in SAME_BITS:
                same = all(torch.equal(mma_kernels.launch(x[:m], ws[0], n, qtype, tilings, source=source), y)
                           for m, y in want.items())
            us = [1000 * bench_ms([lambda w=w, m=m: mma_kernels.launch(x[:m], w, n, qtype, tilings,
                                                                       source=source) for w in ws], False)
                  for m in (1, 16)]
            base = base or us
            held = [residency(qtype, t, nt, source) for nt, t in enumerate(tilings, 1)]
            rows.append({"set": set_name, "shape": shape, "qtype": qtype, "n": n, "k": k, "variant": name,
                         "tilings": [str(t) for t in tilings], "us_m1": us[0], "us_m16": us[1], "same_bits": same,
                         "residency_m1": held[0], "residency_m16": held[1]})
            print(f"{set_name} {shape:10s} {n}x{k} {name:24s} M=1 {us[0]:7.1f} us ({us[0] - base[0]:+6.1f}; "
                  f"{held[0]['registers']} regs, {held[0]['blocks_per_sm']}/SM)  "
                  f"M=16 {us[1]:7.1f} us ({us[1] - base[1]:+6.1f}; {held[1]['registers']} regs, "
                  f"{held[1]['blocks_per_sm']}/SM)"
                  + ("" if same is None else f"  same bits {same}"), flush=True)
        del ws
        torch.cuda.empty_cache()
        (args.out / "kquant_ablate.json").write_text(json.dumps({"rows": rows, "elapsed_s": time.time() - t0},
                                                                indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
