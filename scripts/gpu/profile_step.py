"""Where a step's time goes: per-kernel CUDA time of one target pass (T=1 and T=16) and of one draft pass at a
synthetic shape, grouped into GEMMs, attention and the rest.

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/profile_step.py [qwen3-8b] [BACKENDS] [--generate]
BACKENDS: cublas (default), triton (skinny GEMMs), triton+attn (and the decode attention kernels).
--generate: instead, whole generations as the synthetic benchmark times them (the CUDA defaults: graphs, pipelined
steps), plain decoding and DFlash at tau 6: kernel time per step against wall time per step.
--context N (with --generate): 128 tokens after a prompt of N tokens (the cache N + 320 rows, as a long-context
benchmark allocates it). The profiled generation prefills its prompt again, so its totals include the prefill's
kernels: each kernel is listed with its calls and time per call, and the decode kernels' (attention_kernel,
skinny_gemm_kernel) are read from those.
"""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from flashdraft.bench.synthetic import build_synthetic
from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.engine.model_prep import resolve_plan
from flashdraft.bench.oracle import PlantedOracle

GEMM_NAMES = ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas", "split_reduce")
ATTENTION_NAMES = ("attention", "fmha", "flash", "softmax", "sdpa")  # before GEMM_NAMES: cuDNN's has "sm90"


def report(title: str, fn, reps: int = 5, warmup: int = 3, top: int = 12) -> None:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    groups, counts, names, calls = defaultdict(float), defaultdict(float), defaultdict(float), defaultdict(float)
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        n = e.name.lower()
        g = ("attention" if any(k in n for k in ATTENTION_NAMES) else
             "gemm" if any(k in n for k in GEMM_NAMES) else "other")
        groups[g] += e.device_time / reps
        counts[g] += 1 / reps
        names[e.name[:90]] += e.device_time / reps
        calls[e.name[:90]] += 1 / reps
    total = sum(groups.values())
    print(f"\n{title}: {total / 1000:.3f} ms of kernel time in {sum(counts.values()):.0f} kernels")
    for g in groups:
        print(f"  {g:10s} {groups[g] / 1000:8.3f} ms  {counts[g]:6.0f} kernels")
    for name, t in sorted(names.items(), key=lambda x: -x[1])[:top]:
        print(f"    {t / 1000:8.3f} ms  {calls[name]:6.0f} calls  {t / calls[name]:8.1f} us/call  {name}")


def main(shape: str, backends: str) -> None:
    dev = torch.device("cuda")
    plan = resolve_plan(dev, "triton" if "triton" in backends else "cublas", "triton" if "attn" in backends else "sdpa",
                        compile=True, block_size=16)
    target, drafter = build_synthetic(shape, dev, torch.bfloat16, 1024, plan=plan)
    engine = Engine(target, None, drafter, context_size=1024, cuda_graphs=False, compile=True)
    decoder = engine.decoder
    seq = decoder.new_sequence()
    decoder.prefill(seq, list(range(1, 300)), SamplingParams(), 0)
    for T in (1, 16):
        tokens = torch.arange(T, device=dev)
        report(f"[{shape}, {backends}] target pass T={T}", lambda: decoder.target_pass(seq, tokens, 299))
    report(f"[{shape}, {backends}] draft pass (block {decoder.block_size})", lambda: decoder.draft(seq, decoder.max_draft))


def generations(shape: str, context: int = 0) -> None:
    """Plain decoding and DFlash at tau 6 (planted), 256 tokens after 32 (or 128 after `context`), the engine's CUDA
    defaults."""
    dev = torch.device("cuda")
    n_prompt, n_new = (context, 128) if context else (32, 256)
    size = max(1024, n_prompt + n_new + 192)
    target, drafter = build_synthetic(shape, dev, torch.bfloat16, size, plan=resolve_plan(dev, block_size=16))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, target.config.vocab_size - 1, (n_prompt,), generator=gen).tolist()
    params = SamplingParams(max_tokens=n_new, ignore_eos=True)
    plain = Engine(target, None, None, context_size=size)
    plain_seq = plain.new_sequence()
    base = plain.generate(prompt, params, 0, sequence=plain_seq)
    engine = Engine(target, None, drafter, context_size=size)
    B = drafter.block_size
    oracle = PlantedOracle(prompt + base.tokens, lambda s: 5, target.config.vocab_size, dev)
    planted = engine.new_sequence(oracle=oracle)
    runs = {"plain decoding": lambda: plain.generate(prompt, params, 0, sequence=plain_seq),
            "DFlash, tau 6": lambda: (oracle.reset(), engine.generate(prompt, params, B - 1, sequence=planted))[1]}
    for title, fn in runs.items():
        fn()  # captures the graphs
        out = fn()
        torch.cuda.synchronize()
        s = out.stats
        print(f"\n[{shape}, {n_prompt}-token prompt] {title}: {s.steps} steps, tau {s.tau:.2f}, wall "
              f"{s.predicted_ms / s.steps:.3f} ms per step (decode phase), "
              f"{(s.predicted_n - 1) / s.predicted_ms * 1000:.1f} tok/s; kernel time per step:")
        report(f"[{shape}] {title}, one whole generation (divide by {s.steps} steps)", fn, reps=1, warmup=1,
               top=25 if context else 12)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--generate" in sys.argv:
        at = sys.argv.index("--context") if "--context" in sys.argv else None
        if at is not None:
            args.remove(sys.argv[at + 1])
        generations(args[0] if args else "qwen3-8b", int(sys.argv[at + 1]) if at is not None else 0)
    else:
        main(args[0] if args else "qwen3-8b", args[1] if len(args) > 1 else "cublas")
