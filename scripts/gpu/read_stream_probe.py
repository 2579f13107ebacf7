"""How fast can a kernel only read a product's bytes on this GPU? The ceiling that #18's k-quant products stream
against, measured apart from any arithmetic: kernels that read a buffer of a real product's size once and fold it
into one word (never written unless it hits a value no random buffer gives), each launch on its own copy of the bytes
(one CUDA graph, the L2 cleared before each replay), timed as scripts/gpu/gguf_run.py's bench_ms does.

    flat    every thread 16-byte loads over the whole buffer, grid-stride, UNROLL loads in flight a thread; the grid
            one wave of resident blocks (x waves) or one block per UNROLL loads of every thread
    chunk   each block one contiguous run of the buffer (tile-major's order), UNROLL 16-byte loads in flight a thread
    bulk    each block one contiguous run, brought into a ring of STAGES shared-memory stages of CH bytes by one
            thread's bulk copies (cp.async.bulk, Hopper's copy engine; an mbarrier a stage), the threads only
            reading shared memory: the loads' issue off the threads
    rows    a k-quant product's order: a warp owns 16 rows of ROWB-byte super-blocks (row_bytes apart) and reads
            one super-block of each of its rows a step, 8-byte loads, SB super-blocks of loads in flight; `tiles`
            the same blocks tile-major (a warp's step one contiguous 16 x ROWB run), `columns` super-block-major
            (every warp's step at the same super-block one run after the other: the GPU sweeps the bytes in
            order, as the grid-stride read does)
    ring    the k-quant kernel's shared-memory ring alone (cp.async of a warp's rows a super-block, STAGES deep,
            waits as the kernel waits, then each lane's fragment bytes read from the stage) on the package's Q4_K
            layout (256-row chunks super-block-major): whether the kernel's way of filling its ring reaches what
            a read alone does (the ablation left the ring and loads at ~2.7 TB/s on the H200, the reads above
            ~3.7), and which warp shape, depth and occupancy would; and the same ring filled by the copy
            engine, one bulk copy a warp and stage (the layout puts a warp's rows of a super-block in one run)

    PYTHONPATH=src python scripts/gpu/read_stream_probe.py OUT [--sizes gemma-gate-up,...]

OUT/read_stream.json and a table on stdout: TB/s = bytes read / median time, beside the copy bandwidth (read +
written) of the same process.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_run import bench_ms, copies_for  # noqa: E402

# name -> (rows, K) of Q4_K products (144 bytes per 256 weights): the bytes a product of that shape reads
SHAPES = {
    "qwen-qkv": (6144, 4096),
    "gemma-full-qk": (18432, 5376),
    "gemma-gate-up": (43008, 5376),
    "qwen-lm-head-q6k": (151936, 4096 * 210 // 144),  # 510 MB, the Q6_K LM head's bytes as Q4_K rows' worth
}

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }
__device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void keep(u32 acc, u32 *out) { if (acc == 0x9E3779B9u) out[blockIdx.x] = acc; }

extern "C" __global__ void __launch_bounds__(256) read_flat(const uint4 *__restrict__ src, u32 n16_32, u32 *out) {
    const u64 n16 = n16_32, stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 acc = 0;
    for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = ld_stream(src + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= fold(v[u]);
    }
    for (; i < n16; i += stride) acc ^= fold(ld_stream(src + i));
    keep(acc, out);
}

extern "C" __global__ void __launch_bounds__(256) read_chunk(const uint4 *__restrict__ src, u32 n16_32, u32 *out) {
    const u64 n16 = n16_32, per = (n16 + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per, hi = min(lo + per, n16);
    u64 i = lo + threadIdx.x;
    u32 acc = 0;
    for (; i + (UNROLL - 1) * blockDim.x < hi; i += UNROLL * blockDim.x) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = ld_stream(src + i + u * blockDim.x);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= fold(v[u]);
    }
    for (; i < hi; i += blockDim.x) acc ^= fold(ld_stream(src + i));
    keep(acc, out);
}

__device__ __forceinline__ u32 smem_addr(const void *p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk_to_shared(void *dst, const void *src, u32 bytes, u64 *bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void wait_phase(u64 *bar, u32 parity) {
    asm volatile("{ .reg .pred done; WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;"
                 " @!done bra WAIT_%=; }" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}

// each block: chunks of CH bytes of its run, STAGES of them in flight (n16 * 16 a multiple of gridDim.x * CH)
extern "C" __global__ void __launch_bounds__(256) read_bulk(const unsigned char *__restrict__ src, u32 nbytes,
                                                            u32 *out) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) u64 full[STAGES];
    const u64 per = (u64)nbytes / gridDim.x;
    const unsigned char *run = src + blockIdx.x * per;
    const int chunks = (int)(per / CH);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&full[s])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int s = 0; s < STAGES && s < chunks; ++s) bulk_to_shared(ring + s * CH, run + (u64)s * CH, CH, &full[s]);
    u32 acc = 0;
    for (int c = 0; c < chunks; ++c) {
        const int s = c % STAGES;
        wait_phase(&full[s], (c / STAGES) & 1);
        const uint4 *p = (const uint4 *)(ring + s * CH);
#pragma unroll 4
        for (int i = threadIdx.x; i < CH / 16; i += blockDim.x) acc ^= fold(p[i]);
        __syncthreads();  // every thread done with stage s before it is refilled
        if (threadIdx.x == 0 && c + STAGES < chunks)
            bulk_to_shared(ring + s * CH, run + (u64)(c + STAGES) * CH, CH, &full[s]);
    }
    keep(acc, out);
}

// k-quant order: rows of nsb super-blocks of ROWB bytes; warp w of the grid owns rows 16 w .. 16 w + 15; a step
// reads super-block sb of each of its rows (16 x ROWB bytes as 8-byte loads), SB steps of loads in flight. ORDER 1:
// the same blocks tile-major, [rows / 16][nsb][16][ROWB]: a step one contiguous run; ORDER 2: super-block-major,
// [nsb][rows / 16][16][ROWB]: the warps' steps at the same super-block are adjacent runs.
extern "C" __global__ void __launch_bounds__(128) read_rows(const unsigned char *__restrict__ w, int rows, int nsb,
                                                            u32 *out) {
    const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp * 16 >= rows) return;
    constexpr int PIECES = 16 * ROWB / 8, PER_LANE = (PIECES + 31) / 32;
    u32 acc = 0;
    for (int sb = 0; sb < nsb; sb += SB) {
        uint2 v[SB][PER_LANE];
#pragma unroll
        for (int s = 0; s < SB; ++s)
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) {
                const int piece = lane + 32 * k, r = piece / (ROWB / 8), b = piece % (ROWB / 8);
                const int at = min(sb + s, nsb - 1);
#if ORDER == 2
                const unsigned char *p = w + (((u64)at * (rows / 16) + warp) * 16 + r) * ROWB + 8 * b;
#elif ORDER == 1
                const unsigned char *p = w + (((u64)warp * nsb + at) * 16 + r) * ROWB + 8 * b;
#else
                const unsigned char *p = w + ((u64)warp * 16 + r) * nsb * ROWB + (u64)at * ROWB + 8 * b;
#endif
                v[s][k] = piece < PIECES ? __ldg((const uint2 *)p) : make_uint2(0, 0);
            }
#pragma unroll
        for (int s = 0; s < SB; ++s)
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) acc ^= v[s][k].x ^ v[s][k].y;
    }
    keep(acc, out);
}

// The k-quant kernel's ring (kquant_mma.cu with STAGES > 0) alone, on Q4_K rows in 256-row chunks super-block-major
// (the package's Q4_K_COLUMNS): blocks of WARPS warps, a warp RT 16-row tiles; a super-block of the warp's rows
// copied into a ring of STAGES stages (rows RINGB bytes apart) by each lane's 16-byte cp.async (L1CA 1: .ca, else
// .cg), STAGES - 1 ahead, waited for and __syncwarp'd as the kernel does; then each lane reads the bytes of its
// fragments (rows g, g + 8 of each tile: the 16-byte header and four 8-byte quant words) and folds them (CONSUME 0:
// not read, the copies and waits alone).
// where row `row`'s first super-block lies in the package's layout (256-row chunks, a chunk's super-block after
// super-block: CHUNK_SB bytes apart)
#define CHUNK_SB (256 * 144)
__device__ __forceinline__ const unsigned char *chunk_row(const unsigned char *w, int row, int nsb) {
    return w + (u64)(row / 256) * nsb * CHUNK_SB + (u64)(row % 256) * 144;
}
// the bytes of this lane's fragments in a stage whose rows lie rowb apart, folded into acc: rows g, g + 8 of each
// tile, the 16-byte header and four 8-byte quant words, as the kernel reads them
__device__ __forceinline__ u32 fold_stage(const unsigned char *stage, int rowb, int g, int c, u32 acc) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const unsigned char *blk = stage + (r * 16 + g + 8 * hh) * rowb;
            acc ^= fold(*(const uint4 *)blk);
#pragma unroll
            for (int gq = 0; gq < 4; ++gq) {
                const uint2 q = *(const uint2 *)(blk + 16 + 32 * gq + 8 * c);
                acc ^= q.x ^ q.y;
            }
        }
    return acc;
}
__device__ __forceinline__ void ring_copy(u32 dst, const void *src) {
#if L1CA
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
#endif
}
extern "C" __global__ void __launch_bounds__(32 * WARPS) read_ring(const unsigned char *__restrict__ w, int rows,
                                                                   int nsb, u32 *out) {
    extern __shared__ __align__(16) unsigned char sm[];
    constexpr int STAGE = RT * 16 * RINGB, TOTAL = RT * 16 * 9, PER = (TOTAL + 31) / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int row0 = (blockIdx.x * WARPS + warp) * RT * 16;
    if (row0 >= rows) return;
    const unsigned char *ring = sm + warp * STAGES * STAGE;
    const u32 ring_addr = smem_addr(ring);
    const unsigned char *src[PER];
    u32 dst[PER];
    bool on[PER];
#pragma unroll
    for (int t = 0; t < PER; ++t) {
        const int i = lane + 32 * t, r = i / 9, col = i % 9, row = row0 + (i < TOTAL ? r : 0);
        on[t] = i < TOTAL;
        src[t] = chunk_row(w, row, nsb) + 16 * col;
        dst[t] = ring_addr + r * RINGB + 16 * col;
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
#pragma unroll
        for (int t = 0; t < PER; ++t)
            if (on[t] && s < nsb) ring_copy(dst[t] + s * STAGE, src[t] + s * CHUNK_SB);
        asm volatile("cp.async.commit_group;");
    }
    u32 acc = 0;
    for (int sb = 0; sb < nsb; ++sb) {
        const int stage = sb % STAGES;
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES >= 2 ? STAGES - 2 : 0));
        __syncwarp();
        const int ahead = sb + STAGES - 1, slot = (stage + STAGES - 1) % STAGES;
#pragma unroll
        for (int t = 0; t < PER; ++t)
            if (on[t] && ahead < nsb) ring_copy(dst[t] + slot * STAGE, src[t] + ahead * CHUNK_SB);
        asm volatile("cp.async.commit_group;");
#if CONSUME
        acc = fold_stage(ring + stage * STAGE, RINGB, g, c, acc);
#endif
    }
    keep(acc, out);
}

// The same ring filled by the copy engine: in the package's layout a warp's rows at one super-block are one
// contiguous run (RT x 16 x 144 bytes, inside one 256-row chunk), so lane 0 brings a stage with one
// cp.async.bulk (an mbarrier a stage) where the lanes issued 9 x RT x 16 / 32 cp.async each; rows then lie 144
// bytes apart in the ring (the fragments' 8-byte reads meet 2-way bank conflicts there, which CONSUME includes).
extern "C" __global__ void __launch_bounds__(32 * WARPS) read_ring_bulk(const unsigned char *__restrict__ w,
                                                                        int rows, int nsb, u32 *out) {
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ __align__(8) u64 full[WARPS][STAGES];
    constexpr int STAGE = RT * 16 * 144;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int row0 = (blockIdx.x * WARPS + warp) * RT * 16;
    if (row0 >= rows) return;
    unsigned char *ring = sm + warp * STAGES * STAGE;
    const unsigned char *run = chunk_row(w, row0, nsb);
    if (lane == 0) {
        for (int s = 0; s < STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&full[warp][s])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < STAGES - 1 && s < nsb; ++s)
            bulk_to_shared(ring + s * STAGE, run + s * CHUNK_SB, STAGE, &full[warp][s]);
    }
    __syncwarp();
    u32 acc = 0;
    for (int sb = 0; sb < nsb; ++sb) {
        const int stage = sb % STAGES;
        wait_phase(&full[warp][stage], (sb / STAGES) & 1);
        __syncwarp();  // every lane done with the stage refilled next
        const int ahead = sb + STAGES - 1, slot = (stage + STAGES - 1) % STAGES;
        if (lane == 0 && ahead < nsb) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            bulk_to_shared(ring + slot * STAGE, run + ahead * CHUNK_SB, STAGE, &full[warp][slot]);
        }
#if CONSUME
        acc = fold_stage(ring + stage * STAGE, 144, g, c, acc);
#endif
    }
    keep(acc, out);
}
"""


# every kernel of SOURCE reads these macros; a build sets those of its own kernel
DEFINES = {"UNROLL": 1, "STAGES": 1, "CH": 16, "ROWB": 144, "SB": 1, "ORDER": 0, "RT": 1, "WARPS": 1, "RINGB": 160,
           "L1CA": 0, "CONSUME": 1}
KINDS = ("flat", "chunk", "bulk", "rows", "tiles", "columns", "ring")
# the ring kind's builds, (RT, WARPS, STAGES, CONSUME, L1CA, blocks a multiprocessor): Gemma gate|up's adopted
# one-row tiling first (2 tiles, 2 warps, 3 stages; 6 blocks a multiprocessor, as the kernel's registers allow, here
# by asking for more shared memory), then as many blocks as the ring's shared memory allows (the probe's few
# registers cap nothing), without the reads, through L1, other ring depths and warp shapes, and (L1CA 2) the ring
# filled by bulk copies
RINGS = ((2, 2, 3, 1, 0, 6), (2, 2, 3, 1, 0, 0), (2, 2, 3, 0, 0, 6), (2, 2, 3, 1, 1, 6), (2, 2, 2, 1, 0, 6),
         (2, 2, 4, 1, 0, 6), (1, 2, 3, 1, 0, 0), (1, 4, 3, 1, 0, 0), (2, 4, 3, 1, 0, 0), (4, 2, 3, 1, 0, 0),
         (4, 1, 3, 1, 0, 0), (2, 2, 3, 1, 2, 6), (2, 2, 3, 1, 2, 0), (2, 2, 4, 1, 2, 0), (4, 2, 3, 1, 2, 0))
SHARED_PER_SM = 228 * 1024  # Hopper: a multiprocessor's shared memory, of which the driver keeps 1 KB a block


@functools.cache
def compile_kernel(name: str, **defines: int):
    head = "".join(f"#define {k} {v}\n" for k, v in {**DEFINES, **defines}.items())
    return torch.cuda._compile_kernel(head + SOURCE, name)


def variants(nbytes: int, sms: int, rows: int, k: int, kinds: set[str]):
    """(label, kernel, grid, block, shared bytes, args-of(buffer, out), bytes read) of the reads of these kinds for
    one buffer size."""
    n16 = nbytes // 16
    for unroll in (4, 8):
        if "flat" in kinds:
            kern = compile_kernel("read_flat", UNROLL=unroll)
            for waves in (1, 2, 4):  # blocks of 256 threads, 8 a multiprocessor resident at most
                yield (f"flat u{unroll} {waves * 8}/SM", kern, (sms * 8 * waves, 1, 1), (256, 1, 1), 0,
                       lambda b, o: [b, n16, o], nbytes)
            yield (f"flat u{unroll} whole", kern, (max(1, n16 // (256 * unroll)), 1, 1), (256, 1, 1), 0,
                   lambda b, o: [b, n16, o], nbytes)
        if "chunk" in kinds:
            kern = compile_kernel("read_chunk", UNROLL=unroll)
            for per_sm in (4, 8):
                yield (f"chunk u{unroll} {per_sm}/SM", kern, (sms * per_sm, 1, 1), (256, 1, 1), 0,
                       lambda b, o: [b, n16, o], nbytes)
    for ch, stages, per_sm in ((16384, 4, 2), (16384, 6, 2), (8192, 8, 2), (32768, 3, 2), (16384, 4, 3)):
        if "bulk" not in kinds:
            break
        kern = compile_kernel("read_bulk", STAGES=stages, CH=ch)
        kern.set_shared_memory_config(ch * stages)
        blocks = sms * per_sm
        usable = nbytes // (blocks * ch) * (blocks * ch)  # whole chunks a block (the rest, < blocks * CH, unread)
        yield (f"bulk {ch // 1024}K x{stages} {per_sm}/SM ({usable / nbytes:.3f} of it)", kern, (blocks, 1, 1),
               (256, 1, 1), ch * stages, lambda b, o, u=usable: [b, u, o], usable)
    nsb = k // 256
    for order, label in enumerate(("rows", "tiles", "columns")):
        for sb in (1, 2, 4) if label in kinds else ():
            kern = compile_kernel("read_rows", SB=sb, ORDER=order)
            yield (f"{label} sb{sb}", kern, (-(-rows // 64), 1, 1), (128, 1, 1), 0,
                   lambda b, o: [b, rows, nsb, o], nbytes)
    for rt, warps, stages, consume, l1ca, per_sm in RINGS if "ring" in kinds and rows % 256 == 0 else ():
        bulk = l1ca == 2
        kern = compile_kernel("read_ring_bulk" if bulk else "read_ring", RT=rt, WARPS=warps, STAGES=stages,
                              CONSUME=consume, L1CA=int(l1ca == 1))
        shared = warps * stages * rt * 16 * (144 if bulk else 160)
        if per_sm:  # at most per_sm blocks a multiprocessor: enough shared memory that one more does not fit
            shared = max(shared, SHARED_PER_SM // (per_sm + 1) - 1024 + 16)
        kern.set_shared_memory_config(shared)
        how = ("" if consume else ", not read") + {0: "", 1: ", .ca", 2: ", bulk copies"}[l1ca] + (
            f", {per_sm}/SM" if per_sm else "")
        yield (f"ring {rt} tiles x {warps} warps, {stages} stages{how}", kern, (-(-rows // (16 * rt * warps)), 1, 1),
               (32 * warps, 1, 1), shared, lambda b, o: [b, rows, nsb, o], nbytes)


def copy_bandwidth(dev) -> float:
    """TB/s of a 1 GiB device copy, bytes read plus written."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * a.numel() / bench_ms([lambda: b.copy_(a)], False) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--sizes", default=",".join(SHAPES))
    ap.add_argument("--kinds", default=",".join(KINDS), help="the reads to time")
    args = ap.parse_args()
    kinds = set(args.kinds.split(","))
    if kinds - set(KINDS):
        ap.error(f"unknown kinds {sorted(kinds - set(KINDS))} (known: {', '.join(KINDS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy_tb_s = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, copy {copy_tb_s:.2f} TB/s (read + written, 1 GiB)",
          flush=True)
    results = {"device": torch.cuda.get_device_name(dev), "copy_tb_s": copy_tb_s, "sizes": {}}
    for name in args.sizes.split(","):
        rows, k = SHAPES[name]
        nbytes = rows * (k // 256) * 144
        copies = copies_for(nbytes, False)
        bufs = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev) for _ in range(copies)]
        out = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
        rows_out = {}
        print(f"\n{name}: {nbytes / 1e6:.1f} MB, {copies} copies", flush=True)
        for label, kern, grid, block, shared, args_of, read in variants(nbytes, sms, rows, k, kinds):
            fns = [lambda buf=buf: kern(grid=grid, block=block, args=args_of(buf, out), shared_mem=shared)
                   for buf in bufs]
            try:
                ms = bench_ms(fns, False)
            except Exception as e:  # noqa: BLE001 - a variant that does not launch is reported, not fatal
                print(f"  {label:40s} failed: {type(e).__name__}: {e}", flush=True)
                continue
            rows_out[label] = {"us": 1000 * ms, "tb_s": read / ms / 1e9}
            print(f"  {label:40s} {1000 * ms:8.1f} us  {read / ms / 1e9:5.2f} TB/s", flush=True)
        results["sizes"][name] = {"bytes": nbytes, "variants": rows_out}
        del bufs
        torch.cuda.empty_cache()
    (args.out / "read_stream.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
