"""Where a decode step's time goes: per-kernel CUDA time of one target pass (T=1 and T=16) at a synthetic
shape, grouped into GEMMs, attention and the rest, against the bandwidth floor.

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/profile_step.py [qwen3-8b]
"""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from flashdraft.bench.synthetic import build_synthetic
from flashdraft.engine.generator import Engine


def main(shape: str) -> None:
    dev = torch.device("cuda")
    target, drafter = build_synthetic(shape, dev, torch.bfloat16, 1024)
    engine = Engine(target, None, drafter, context_size=1024, cuda_graphs=False, compile=True)
    seq = engine.decoder.new_sequence()
    from flashdraft.config import SamplingParams
    engine.decoder.prefill(seq, list(range(1, 300)), SamplingParams(), 0)
    for T in (1, 16):
        tokens = torch.arange(T, device=dev)
        for _ in range(3):
            engine.decoder._verify(seq, tokens, 299)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.decoder._verify(seq, tokens, 299)
            torch.cuda.synchronize()
        groups, counts = defaultdict(float), defaultdict(int)
        names = defaultdict(float)
        for e in prof.events():
            if e.device_type.name != "CUDA":
                continue
            n = e.name.lower()
            g = ("gemm" if any(k in n for k in ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas")) else
                 "attention" if any(k in n for k in ("attention", "fmha", "flash", "softmax")) else "other")
            groups[g] += e.device_time / 5
            counts[g] += 1 / 5
            names[e.name[:90]] += e.device_time / 5
        total = sum(groups.values())
        print(f"\n[{shape}] target pass T={T}: {total / 1000:.3f} ms of kernel time in {sum(counts.values()):.0f} kernels")
        for g in groups:
            print(f"  {g:10s} {groups[g] / 1000:8.3f} ms  {counts[g]:6.0f} kernels")
        for name, t in sorted(names.items(), key=lambda x: -x[1])[:12]:
            print(f"    {t / 1000:8.3f} ms  {name}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b")
