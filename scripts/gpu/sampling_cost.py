"""Cost of sampling one step's rows on the GPU, captured in a CUDA graph as the engine runs it; agreement of the
Gumbel-max kernel with the torch ops that define it, and with another implementation of the engine's sampling (a
file, e.g. an older commit's engine/sampling.py or engine/speculative.py), for the same seed.

    PYTHONPATH=src python scripts/gpu/sampling_cost.py [--reference OLD_MODULE.py]

Logits: bf16 N(0, 3) over Qwen3's 151,936-token vocabulary (many ties, as bf16 logits have)."""
from __future__ import annotations

import argparse
import importlib.util

import torch

from flashdraft.config import SamplingParams
from flashdraft.engine import speculative as sampling

SETTINGS = {"T 0.7, top-k 64, top-p 0.95": SamplingParams(temperature=0.7, top_k=64, top_p=0.95),
            "T 0.7, top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
            "T 0.7": SamplingParams(temperature=0.7), "greedy": SamplingParams()}


def graph_us(fn, iters: int = 200) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", help="another module with sample_tokens (an older engine/sampling.py or "
                    "engine/speculative.py) to time and compare tokens with")
    args = ap.parse_args()
    impls = {"this": sampling}
    if args.reference:
        spec = importlib.util.spec_from_file_location("reference_sampling", args.reference)
        impls["reference"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(impls["reference"])
    dev = torch.device("cuda")
    key = sampling.seed_key(1, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{'setting':30s} rows " + " ".join(f"{name + ' us':>14s}" for name in impls)
          + "  kernel/ops differing" + ("  this/reference differing" if len(impls) > 1 else ""))
    for label, params in SETTINGS.items():
        for rows in (1, 16):
            logits = (torch.randn(rows, 151936, device=dev, generator=g) * 3).bfloat16()
            positions = torch.arange(100, 100 + rows, device=dev)
            times = [graph_us(lambda m=m: m.sample_tokens(logits, params, key, positions)) for m in impls.values()]
            line = f"{label:30s} {rows:4d} " + " ".join(f"{t:14.1f}" for t in times)
            ops_differ = ref_differ = total = 0
            for trial in range(64):  # 64 x 16 rows of fresh logits
                x = (torch.randn(16, 151936, device=dev, generator=g) * 3).bfloat16()
                pos = torch.arange(16 * trial, 16 * trial + 16, device=dev)
                this = sampling.sample_tokens(x, params, key, pos)
                if not params.greedy:
                    warped, ids = sampling.warped_candidates(x, params)
                    ops_differ += int((sampling.gumbel_max(warped, ids, key, pos, kernel=False) != this).sum())
                if len(impls) > 1:
                    ref_differ += int((impls["reference"].sample_tokens(x, params, key, pos) != this).sum())
                total += 16
            line += f"  {ops_differ}/{total}" + (f"  {ref_differ}/{total}" if len(impls) > 1 else "")
            print(line, flush=True)


if __name__ == "__main__":
    main()
