"""Where a step's time goes: per-kernel CUDA time of one target pass (T=1 and T=16) and of one draft pass at a
synthetic shape, grouped into GEMMs, attention and the rest.

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/profile_step.py [qwen3-8b] [BACKENDS]
BACKENDS: cublas (default), triton (skinny GEMMs), triton+attn (and the decode attention kernels).
"""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from flashdraft.bench.synthetic import build_synthetic
from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine

GEMM_NAMES = ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas", "split_reduce")
ATTENTION_NAMES = ("attention", "fmha", "flash", "softmax", "sdpa")  # before GEMM_NAMES: cuDNN's has "sm90"


def report(title: str, fn, reps: int = 5) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    groups, counts, names = defaultdict(float), defaultdict(float), defaultdict(float)
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        n = e.name.lower()
        g = ("attention" if any(k in n for k in ATTENTION_NAMES) else
             "gemm" if any(k in n for k in GEMM_NAMES) else "other")
        groups[g] += e.device_time / reps
        counts[g] += 1 / reps
        names[e.name[:90]] += e.device_time / reps
    total = sum(groups.values())
    print(f"\n{title}: {total / 1000:.3f} ms of kernel time in {sum(counts.values()):.0f} kernels")
    for g in groups:
        print(f"  {g:10s} {groups[g] / 1000:8.3f} ms  {counts[g]:6.0f} kernels")
    for name, t in sorted(names.items(), key=lambda x: -x[1])[:12]:
        print(f"    {t / 1000:8.3f} ms  {name}")


def main(shape: str, backends: str) -> None:
    dev = torch.device("cuda")
    target, drafter = build_synthetic(shape, dev, torch.bfloat16, 1024)
    engine = Engine(target, None, drafter, context_size=1024, cuda_graphs=False, compile=True,
                    gemm="triton" if "triton" in backends else "cublas",
                    attention="triton" if "attn" in backends else "sdpa")
    decoder = engine.decoder
    seq = decoder.new_sequence()
    decoder.prefill(seq, list(range(1, 300)), SamplingParams(), 0)
    for T in (1, 16):
        tokens = torch.arange(T, device=dev)
        report(f"[{shape}, {backends}] target pass T={T}", lambda: decoder._verify(seq, tokens, 299))
    report(f"[{shape}, {backends}] draft pass (block {decoder.block_size})", lambda: decoder._draft(seq, decoder.max_draft))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b", sys.argv[2] if len(sys.argv) > 2 else "cublas")
