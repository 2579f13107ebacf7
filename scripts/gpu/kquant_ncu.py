"""One k-quant product launched a few times, for Nsight Compute to profile one launch: where the one-row Q4_K
stream's time goes (stall reasons, occupancy, DRAM throughput) on the card at hand. Issue #18: Gemma-4-31B's Q4_K
gate|up streams at ~2.0 TB/s on the H100, 73% of a read alone of its bytes, while its loop fills only ~28% of the
issue slots (docs/performance.md, session 43): the kernel waits more than it issues, and the counters say on what.

    ncu --clock-control none -k regex:kq_mma --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats \\
        --section MemoryWorkloadAnalysis --print-details all \\
        python scripts/gpu/kquant_ncu.py gemma-step "gate|up" --rows 1 [--variant "all arithmetic"] [--gguf-order]

The shape comes from mma_tilings.py's sets, the tiling is the adopted one (mma_kernels.tilings_for), the variant
one of kquant_ablate.py's (the kernel's text with a stage left out). Q4_K weights whose rows fill the package's
chunks are laid out as the loader keeps them (Q4_K_COLUMNS), unless --gguf-order. Without ncu it prints the
launch's time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_run import as_loaded, random_blocks  # noqa: E402
from kquant_ablate import VARIANTS, applies, variant_source  # noqa: E402
from mma_tilings import SETS  # noqa: E402

from flashdraft.quant import mma_kernels  # noqa: E402

LAUNCHES = 6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("set", choices=sorted(SETS))
    ap.add_argument("shape")
    ap.add_argument("--rows", type=int, default=1, help="rows of x, 1 to 16")
    ap.add_argument("--variant", default="as is", choices=sorted(VARIANTS))
    ap.add_argument("--gguf-order", action="store_true", help="Q4_K in GGUF's row order, not the package's layout")
    args = ap.parse_args()
    qtype, shapes = SETS[args.set]
    if args.shape not in shapes:
        ap.error(f"set {args.set} has no shape {args.shape!r}; it has {', '.join(shapes)}")
    if not 1 <= args.rows <= 16:
        ap.error(f"--rows is 1 to 16, not {args.rows}")
    n, k = shapes[args.shape]
    if not applies(args.variant, qtype):
        ap.error(f"variant {args.variant!r} changes only the Q4_K / Q5_K part of the kernel, not {qtype}'s")
    source = variant_source(args.variant, mma_kernels.SOURCE.read_text())
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    (w,), qtype = as_loaded(qtype, [random_blocks(qtype, n, k, gen, dev)], args.gguf_order)
    x = torch.randn(args.rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
    tilings = mma_kernels.tilings_for(qtype, n, k)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(LAUNCHES):
        start.record()
        mma_kernels.launch(x, w, n, qtype, tilings, source=source)
        end.record()
        torch.cuda.synchronize()
        print(f"launch {i}: {1000 * start.elapsed_time(end):.1f} us ({args.set} {args.shape} {n}x{k}, M={args.rows}, "
              f"{args.variant}, tiling {tilings[0 if args.rows <= 8 else 1]})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
