"""GGUF k-quant weights (Q4_K, Q5_K, Q6_K in lane order) times 1-16 rows of bf16 x with a CUDA kernel written
against the tensor cores' register fragments (kquant_mma.cu), compiled at first use by NVRTC through
torch.cuda._compile_kernel: no build step and no nvcc.

Why a hand-written kernel: Triton's tl.dot takes decoded weights through shared memory (2-byte reads, byte
permutes and barriers per K step; scripts/gpu/q4k_lab.py measured every formulation at 16-24% of the bandwidth
roofline on the H200). Here each lane loads exactly the bytes of its own MMA fragments, so nothing but the
weights' and x's loads touch memory, and the scales apply per 32-weight sub-block in fp32 on exact integer-valued
products, so it runs about twice as fast as the Triton kernel at one row, and the weights are never rounded
(docs/performance.md).

Q4_K also comes super-block-major in chunks of rows (Q4_K_COLUMNS, flashdraft.quant.q4k_columns: the warps read long
stretches of memory in order; the same arithmetic, so the same bits, and Q4_K's tilings). There a warp's rows at one
super-block are one run of bytes, so on compute capability 9.0 a tiling may have the copy engine fill its ring
(MmaTiling.bulk: one bulk copy a warp and stage where the lanes issue a 16-byte copy per 16 bytes, and the lanes
keep no copy addresses: fewer registers), a choice of the tiling sweep like the others (docs/performance.md).

Used by flashdraft.quant.linear for these types when x is bf16 with at most MAX_ROWS rows, K a multiple of 256 and N
of 16, on a GPU of compute capability 8.0 or newer; anything else, or a failed compile (warned once), goes to the
Triton kernels. Q6_K comes as QuantLinear keeps it, in lane order (flashdraft.quant.q6k_lanes: 16-byte loads where
GGUF's 210-byte blocks allow 2-byte ones). Q5_K and Q6_K do the arithmetic of Q4_K's kernel with their own bit
unpacking (the kernel's header). Rows are bitwise the same for every M <= 16 (batch invariance: the kernel's header
says why; the tilings for up to 8 and for 9-16 rows of a shape split K alike).

On compute capability 9.0 and newer every product is a programmatic dependent launch (kernels.programmatic): it
prefetches its first weights into L2 while the kernel before it ends, and lets the next kernel launch once its
own last weights are read, so that a decode step's short products do not each start on an idle memory bus.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.kernels import programmatic
from flashdraft.kernels.runtime import gpu_sm_count
from flashdraft.quant import q4k_columns
from flashdraft.quant.formats import row_bytes

MAX_ROWS = 16
SOURCE = Path(__file__).with_name("kquant_mma.cu")
# the kernel's QTYPE per type; Q4_K_COLUMNS is Q4_K read super-block-major (flashdraft.quant.q4k_columns: COLUMNS),
# with Q4_K's tilings (the same arithmetic)
QTYPES = {"Q4_K": 4, "Q4_K_COLUMNS": 4, "Q5_K": 5, "Q6_K_LANES": 6}
# per super-block of 256 weights (Q6_K: d apart)
BLOCK_BYTES = {"Q4_K": 144, "Q4_K_COLUMNS": 144, "Q5_K": 176, "Q6_K_LANES": 208}
# bytes a row of a super-block takes in a shared-memory ring stage (the block padded to 8 or 24 mod 32 words: the
# kernel's header says why); none for Q6_K
RING_ROW_BYTES = {"Q4_K": 160, "Q4_K_COLUMNS": 160, "Q5_K": 224}


@dataclass(frozen=True)
class MmaTiling:
    """Work per warp and grid shape; chosen per (N, K), the SM count and whether x has more than 8 rows. Tilings
    with the same K split give the same bits (the same sums in the same order), so the split never depends on M."""

    r_tiles: int = 2      # 16-row tiles per warp
    warps: int = 2        # warps per block
    split: int = 1        # K ranges, each a program column; a divisor of K / 256
    min_blocks: int = 1   # __launch_bounds__ blocks per SM (caps the registers a thread may use)
    stages: int = 0       # 0: fragments loaded from global memory; n >= 2: a ring of n super-blocks per warp in
                          # shared memory, filled by cp.async n - 1 ahead (kquant_mma.cu says why)
    bulk: bool = False    # the ring filled by the copy engine, one cp.async.bulk a warp and stage (Q4_K_COLUMNS on
                          # compute capability 9.0; rows unpadded)

    def __post_init__(self):
        if self.stages == 1 or self.stages < 0:
            raise ValueError(f"stages is 0 or at least 2, not {self.stages}")
        if self.bulk and not self.stages:
            raise ValueError("the copy engine fills a ring: bulk needs stages >= 2")

    def shared_bytes(self, qtype: str) -> int:
        """The dynamic shared memory a block of this tiling takes for weights of this type."""
        if self.stages and qtype not in RING_ROW_BYTES:
            raise ValueError(f"{qtype} weights take no shared-memory ring (stages 0), got stages {self.stages}")
        if self.bulk and qtype != q4k_columns.QTYPE:
            raise ValueError(f"the copy engine fills the ring of {q4k_columns.QTYPE} weights only, not {qtype}")
        row = BLOCK_BYTES[qtype] if self.bulk else RING_ROW_BYTES.get(qtype, 0)
        return self.warps * self.stages * self.r_tiles * 16 * row


# (type, N, K) -> the tilings for 1-8 and for 9-16 rows of x: per shape the K split with the lowest M = 1 plus M = 16
# time, each with the fastest tiling of that split at its row count (scripts/gpu/mma_tilings.py on an H200,
# 2026-12-03, the kernel with its per-super-block correction; docs/performance.md). One K split per shape, so that
# every M gives the same bits; other shapes get default_tiling for both.
TILINGS: dict[tuple[str, int, int], tuple[MmaTiling, MmaTiling]] = {
    ("Q4_K", 21504, 5376): (MmaTiling(1, 4, 1, 2, 3), MmaTiling(1, 2, 1, 6)),     # gate/up: 29.2 / 44.3 us, M 1 / 16
    ("Q4_K", 8192, 5376): (MmaTiling(1, 4, 3, 2, 3), MmaTiling(1, 2, 3, 6)),      # sliding q: 14.7 / 19.3 us
    ("Q4_K", 4096, 5376): (MmaTiling(1, 2, 7, 1), MmaTiling(2, 4, 7, 1)),        # sliding k/v: 10.0 / 12.8 us
    ("Q4_K", 5376, 8192): (MmaTiling(1, 4, 4, 1, 3), MmaTiling(1, 2, 4, 6)),      # sliding o: 15.5 / 21.1 us
    ("Q4_K", 16384, 5376): (MmaTiling(1, 4, 1, 1, 3), MmaTiling(1, 2, 1, 1, 3)),  # full q: 22.9 / 32.2 us
    ("Q4_K", 2048, 5376): (MmaTiling(1, 4, 7, 1, 3), MmaTiling(1, 4, 7, 1)),      # full k: 7.8 / 9.4 us
    # fused projections (gate|up; Gemma 4's full q|k, its sliding q|k|v being full q's shape; Qwen3-8B's q|k|v),
    # and Qwen3-8B's Q4_K shapes: the same sweep, 2026-12-03 evening (docs/perf/h200-sbs-2026-12-03-eve)
    ("Q4_K", 18432, 5376): (MmaTiling(1, 4, 1, 1, 3), MmaTiling(1, 2, 1, 6)),     # Gemma full q|k: 28.4 / 43.7 us
    ("Q4_K", 6144, 4096): (MmaTiling(1, 4, 4, 1), MmaTiling(1, 2, 4, 6)),        # Qwen q|k|v: 10.2 / 17.0 us
    ("Q4_K", 24576, 4096): (MmaTiling(1, 4, 1, 1, 3), MmaTiling(1, 2, 1, 6)),     # Qwen gate|up: 23.9 / 36.6 us
    ("Q4_K", 4096, 4096): (MmaTiling(1, 2, 2, 1, 3), MmaTiling(1, 2, 2, 1, 3)),   # Qwen q, o: 8.8 / 13.8 us
    # the Q5_K Gemma-4-31B drafter and Qwen3-8B Q4_K_M's other shapes: the same sweep,
    # 2026-12-04 (docs/perf/h200-2026-12-04; the default tiling's M = 16 time in brackets)
    ("Q5_K", 21504, 5376): (MmaTiling(1, 2, 1, 1, 3), MmaTiling(1, 2, 1, 6)),     # drafter gate|up: 33.9 / 50.4 (71.5)
    ("Q5_K", 5376, 10752): (MmaTiling(1, 4, 3, 1, 3), MmaTiling(1, 4, 3, 1, 3)),  # drafter down: 19.3 / 30.0 (47.1)
    ("Q5_K", 10240, 5376): (MmaTiling(1, 4, 3, 1), MmaTiling(1, 4, 3, 1, 3)),     # drafter q|k|v: 18.9 / 32.2 (44.6)
    ("Q5_K", 5376, 8192): (MmaTiling(1, 2, 4, 1, 3), MmaTiling(1, 2, 4, 6)),      # drafter o: 17.0 / 26.5 (43.9)
    ("Q5_K", 5376, 32256): (MmaTiling(2, 2, 6, 1, 3), MmaTiling(2, 4, 6, 1, 3)),  # drafter fc: 46.5 / 71.2 (100.1)
    ("Q5_K", 1024, 5376): (MmaTiling(1, 4, 7, 2, 3), MmaTiling(1, 2, 7, 1, 3)),   # drafter k, v: 6.2 / 13.8 (22.6)
    ("Q4_K", 4096, 12288): (MmaTiling(1, 4, 4, 2, 3), MmaTiling(1, 2, 4, 1, 3)),  # Qwen Q4_K down: 15.5 / 25.9 (40.5)
    ("Q4_K", 1024, 4096): (MmaTiling(1, 4, 4, 1, 3), MmaTiling(1, 2, 4, 1, 3)),   # Qwen Q4_K k: 6.0 / 11.6 (23.2)
    # Qwen3-8B Q4_K_M's q|k beside a Q6_K v (Attention.fuse_projections): measured on an H100, 2026-12-05
    # (docs/perf/h100-2026-12-05d)
    ("Q4_K", 5120, 4096): (MmaTiling(1, 2, 4, 1), MmaTiling(1, 2, 4, 6)),         # Qwen q|k: 10.3 / 16.7 (34.8)
    # the Q6_K shapes in lane order (Qwen3-8B Q4_K_M's, the LM heads): the same sweep on an H100, 2026-12-06
    # (docs/perf/h100-2026-12-06b; the default tiling's M = 16 time in brackets)
    ("Q6_K_LANES", 151936, 4096): (MmaTiling(1, 2, 1, 6), MmaTiling(2, 2, 1, 6)),  # LM head: 194.7 / 288.7 (352.1)
    ("Q6_K_LANES", 4096, 12288): (MmaTiling(1, 4, 6, 1), MmaTiling(1, 2, 6, 6)),   # down: 20.5 / 33.4 (51.8)
    ("Q6_K_LANES", 1024, 4096): (MmaTiling(1, 2, 4, 1), MmaTiling(1, 4, 4, 1)),    # v: 6.3 / 12.2 (24.0)
    ("Q6_K_LANES", 262144, 5376): (MmaTiling(1, 2, 1, 6), MmaTiling(2, 2, 1, 6)),  # Gemma's: 440.1 / 683.2 (765.1)
    # a Q5_K drafter of Qwen3-8B's shape: the same sweep on an H100, 2026-12-06 (docs/perf/h100-2026-12-06d)
    ("Q5_K", 6144, 4096): (MmaTiling(1, 2, 4, 1), MmaTiling(1, 2, 4, 6)),         # drafter q|k|v: 11.3 / 17.4 (36.6)
    ("Q5_K", 4096, 4096): (MmaTiling(1, 2, 4, 1), MmaTiling(1, 4, 4, 1)),         # drafter o: 9.7 / 14.3 (30.5)
    ("Q5_K", 24576, 4096): (MmaTiling(1, 2, 1, 1), MmaTiling(1, 2, 1, 6)),        # drafter gate|up: 32.5 / 43.0 (71.1)
    ("Q5_K", 4096, 12288): (MmaTiling(1, 2, 6, 1), MmaTiling(1, 2, 6, 6)),        # drafter down: 19.4 / 29.0 (44.3)
    ("Q5_K", 4096, 20480): (MmaTiling(1, 2, 4, 1, 3), MmaTiling(1, 4, 4, 1, 3)),  # drafter fc: 30.2 / 41.9 (60.6)
    ("Q5_K", 2048, 4096): (MmaTiling(1, 2, 4, 1, 4), MmaTiling(1, 2, 4, 6)),      # drafter k|v: 6.8 / 12.8 (25.1)
    # Gemma-4-31B's step as it runs: Q4_K_COLUMNS, rings filled by the copy engine among the choices
    # (mma_tilings.py --only gemma-step --copy-engine on an H200, 2026-12-07, docs/perf/h200-2026-12-07-s49; the
    # shapes whose M = 1 plus M = 16 time fell by more than 1%)
    ("Q4_K", 43008, 5376): (MmaTiling(2, 4, 1, 2, 3, bulk=True), MmaTiling(1, 2, 1, 6)),  # gate|up: 47.4 / 81.6 us
    ("Q4_K", 5376, 21504): (MmaTiling(1, 4, 6, 1), MmaTiling(2, 2, 6, 1, 3)),             # down: 27.1 / 47.7 us
    ("Q4_K", 5376, 16384): (MmaTiling(1, 2, 4, 1, 3), MmaTiling(1, 2, 4, 6)),             # full o: 24.4 / 39.6 us
}
MAX_SPLIT = 16
# Launched as a programmatic dependent (kernels.programmatic), a product prefetches into L2 up to this many bytes
# of its weights (the first super-blocks of each warp's K range) while the kernel before it ends
PREFETCH_BYTES = 8 << 20
BLOCKS_PER_SM = 12   # enough warps in flight to cover the loads' latency (the measured tilings give 10-18)


def default_tiling(n: int, k: int, sms: int = 132) -> MmaTiling:
    """Two 16-row tiles per warp, two warps per block, and the smallest K split (a divisor of K / 256, at most
    MAX_SPLIT) giving BLOCKS_PER_SM blocks per multiprocessor, else the largest such divisor: the measured best
    split on every timed shape."""
    tiling = MmaTiling()
    blocks = -(-n // (16 * tiling.r_tiles * tiling.warps))
    splits = [d for d in range(1, MAX_SPLIT + 1) if (k // 256) % d == 0]
    split = next((d for d in splits if blocks * d >= BLOCKS_PER_SM * sms), splits[-1])
    return MmaTiling(tiling.r_tiles, tiling.warps, split, tiling.min_blocks)


def tilings_for(qtype: str, n: int, k: int, sms: int = 132, copy_engine: bool = True) -> tuple[MmaTiling, MmaTiling]:
    """The tilings for up to 8 and for 9-16 rows of x (Q4_K_COLUMNS: Q4_K's), their rings filled by lanes' copies
    where the weights are not Q4_K_COLUMNS or the GPU has no copy engine (copy_engine False)."""
    tilings = TILINGS.get((q4k_columns.file_type(qtype), n, k)) or (default_tiling(n, k, sms),) * 2
    if qtype != q4k_columns.QTYPE or not copy_engine:
        tilings = tuple(dataclasses.replace(t, bulk=False) for t in tilings)
    return tilings


def supported(x: torch.Tensor, blocks: torch.Tensor, out_features: int, qtype: str) -> bool:
    """Whether launch() takes this product (otherwise the Triton kernels do)."""
    k = x.shape[-1]
    if not (qtype in QTYPES and x.is_cuda and x.dtype == torch.bfloat16 and x.numel() // max(k, 1) <= MAX_ROWS
            and k % 256 == 0 and out_features % 16 == 0
            and (qtype != q4k_columns.QTYPE or q4k_columns.fits(out_features))
            and blocks.shape == (out_features, row_bytes(qtype, k))):
        return False
    device_index = _device_index(x)
    return _builds(_tilings_on(device_index, qtype, out_features, k), qtype, device_index)


def _device_index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


@functools.cache
def _tilings_on(device_index: int, qtype: str, n: int, k: int) -> tuple[MmaTiling, MmaTiling]:
    """tilings_for this GPU: its SM count, and the copy engine from compute capability 9.0 on (cached: launch asks
    for every product, and eager passes of a few rows are bound by the host)."""
    return tilings_for(qtype, n, k, gpu_sm_count(device_index),
                       torch.cuda.get_device_capability(device_index) >= (9, 0))


@functools.cache
def _builds(tilings: tuple[MmaTiling, MmaTiling], qtype: str, device_index: int) -> bool:
    """Compute capability >= 8.0 (bf16 mma.sync) and NVRTC builds these tilings' kernels (warned if it does not)."""
    if torch.cuda.get_device_capability(device_index) < (8, 0) or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    try:
        _counters(device_index)
        for nt, tiling in enumerate(tilings, 1):
            _matmul_kernel(_code_of(tiling), nt, qtype, device_index)
    except Exception as e:  # noqa: BLE001 - any failure (no NVRTC, a driver error) means: use the Triton kernels
        warnings.warn(f"flashdraft: the CUDA {qtype} kernel did not compile ({type(e).__name__}: {e}); using the "
                      f"Triton kernels", RuntimeWarning, stacklevel=2)
        return False
    return True


def _code_of(tiling: MmaTiling) -> MmaTiling:
    """The tiling with what only the grid depends on (the K split) set aside: one compile per kernel variant."""
    return dataclasses.replace(tiling, split=1)


def kernel_defines(tiling: MmaTiling, nt: int, qtype: str) -> str:
    """The defines kquant_mma.cu is compiled with for this tiling, NT 8-token tiles and type (its header)."""
    return (f"#define QTYPE {QTYPES[qtype]}\n#define COLUMNS {int(qtype == q4k_columns.QTYPE)}\n"
            f"#define CHUNK_ROWS {q4k_columns.CHUNK_ROWS}\n"
            f"#define R_TILES {tiling.r_tiles}\n#define NT {nt}\n"
            f"#define WARPS {tiling.warps}\n#define MINB {tiling.min_blocks}\n#define STAGES {tiling.stages}\n"
            f"#define RING_BULK {int(tiling.bulk)}\n")


@functools.cache
def _matmul_kernel(tiling: MmaTiling, nt: int, qtype: str, device_index: int, source: str | None = None):
    """kq_mma for this type, tiling and NT 8-token tiles, compiled by NVRTC for and loaded on that GPU (a module is
    loaded per device), from kquant_mma.cu or the given source text."""
    shared = tiling.shared_bytes(qtype)  # refuses a ring for a type that takes none
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(kernel_defines(tiling, nt, qtype) + (source or SOURCE.read_text()),
                                            "kq_mma")
        kernel.set_shared_memory_config(shared)  # past 48 KB a kernel must ask for it
    return kernel


MAX_WARP_COLUMNS = 1 << 16  # warps along N of one product (N / 16 / r_tiles); an LM head of 262144 rows takes 16384


@functools.cache
def _counters(device_index: int) -> torch.Tensor:
    """The split-K arrival counts of a GPU's products (kquant_mma.cu: zero between launches): allocated with the
    first build, outside any CUDA-graph capture. One buffer for the GPU, so two split products must not run at
    once (the engine runs its products in one stream's order; concurrent ones could count into each other)."""
    return torch.zeros(MAX_WARP_COLUMNS, dtype=torch.int32, device=torch.device("cuda", device_index))


def launch(x: torch.Tensor, blocks: torch.Tensor, out_features: int, qtype: str,
           tiling: MmaTiling | tuple[MmaTiling, MmaTiling] | None = None,
           residual: torch.Tensor | None = None, source: str | None = None) -> torch.Tensor:
    """y = x @ W^T for W [out_features, K] held as blocks of qtype (QTYPES); x bf16 [..., K] with at most MAX_ROWS
    rows.
    tiling: one for every M, or the pair for up to 8 and 9-16 rows (of one K split), or None for tilings_for's.
    residual: bf16 [..., out_features] added to y in the kernel's store, the bits of `y + residual` (a launch
    less a layer: the residual stream's add after down_proj).
    source: the kernel's text instead of kquant_mma.cu's (scripts/gpu/kquant_ablate.py times variants of it).
    No host sync; allocates only the output and the fp32 partial sums: safe in CUDA graphs."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != k):
        x2 = x2.contiguous()
    if blocks.stride(1) != 1 or blocks.stride(0) != blocks.shape[1]:
        blocks = blocks.contiguous()
    if blocks.data_ptr() % 16:  # 16-byte loads (Q4_K / Q5_K headers, lane-order Q6_K)
        blocks = blocks.clone()
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    m, n = x2.shape[0], out_features
    if residual is not None:
        if residual.shape != (*lead, n) or residual.dtype != torch.bfloat16 or residual.device != x.device:
            raise ValueError(f"residual must be bf16 {[*lead, n]} on {x.device}, got {residual.dtype} "
                             f"{list(residual.shape)} on {residual.device}")
        residual = residual.reshape(m, n).contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    device_index = _device_index(x)
    if tiling is None:
        tiling = _tilings_on(device_index, qtype, n, k)
    tilings = (tiling, tiling) if isinstance(tiling, MmaTiling) else tiling
    nsb = k // 256
    if tilings[0].split != tilings[1].split:
        raise ValueError(f"the tilings for up to 8 and 9-16 rows split K differently ({tilings[0].split} and "
                         f"{tilings[1].split}): rows would differ with M")
    if nsb % tilings[0].split:
        raise ValueError(f"split {tilings[0].split} does not divide the {nsb} super-blocks of K = {k}")
    # both builds at the first call, so that a later M never compiles during CUDA-graph capture
    builds = [_matmul_kernel(_code_of(t), nt, qtype, device_index, source) for nt, t in enumerate(tilings, 1)]
    matmul, tiling = (builds[0], tilings[0]) if m <= 8 else (builds[1], tilings[1])
    # one K range: the kernel writes y itself (the partial sums and counts are then never read or written)
    part = torch.empty((tiling.split, m, n), dtype=torch.float32, device=x.device) if tiling.split > 1 else y
    rows_per_block = 16 * tiling.r_tiles * tiling.warps
    blocks_n = -(-n // rows_per_block)
    if blocks_n * tiling.warps > MAX_WARP_COLUMNS:
        raise ValueError(f"{n} output features in tiles of {16 * tiling.r_tiles} rows take more than "
                         f"{MAX_WARP_COLUMNS} split-K counts")
    sb_per_split = nsb // tiling.split
    prefetch_sb = min(sb_per_split, PREFETCH_BYTES // (n * tiling.split * BLOCK_BYTES[qtype]))
    call = dict(grid=(blocks_n, tiling.split, 1), block=(32 * tiling.warps, 1, 1),
                args=[blocks, x2, part, y, residual if residual is not None else y, int(residual is not None),
                      _counters(device_index), m, n, nsb, sb_per_split, prefetch_sb],
                shared_mem=tiling.shared_bytes(qtype), stream=torch.cuda.current_stream(x.device))
    if programmatic.supported(device_index):
        programmatic.launch(matmul, **call)
    else:
        matmul(**call)
    return y.reshape(*lead, n)
