"""Where the Q4_K_S-shaped Gemma-4-31B's decode step spends its time (issue #18, item 2): per-kernel CUDA time of
one plain step (T = 1), one verify step (T = 16) and one pass of the Q5_K drafter (its DFlash step's draft), eager
(no graphs, so every kernel is its own record; each kernel's own time: a programmatic launch's wait on the kernel
before it is that kernel's), grouped by kernel family, next to the graphed passes' wall time
and the eager passes' own (a wall time well above the kernel time: the host is the bound);
and a 512-token prefill pass (eager), where pp512 reached half of its prediction with the dequantized copy
(docs/performance.md).

Usage (GPU machine, repo root): PYTHONPATH=src python scripts/gpu/gguf_profile.py OUT [FILE.gguf]
FILE: that model instead (no drafter), e.g. make_gguf.py's Qwen3-8B Q4_K_M.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_run  # noqa: E402

from flashdraft.engine.generator import Engine  # noqa: E402
from flashdraft.config import SamplingParams  # noqa: E402

FAMILIES = (("k-quant mma", ("kq_mma",)), ("compiled layer ops", ("triton_poi", "triton_red", "triton_per")),
            ("split reduce", ("split_reduce",)), ("dequantize", ("_dequantize",)),
            ("triton quant matmul", ("_quant_matmul",)), ("attention", ("attention", "attn", "flash", "sdpa")),
            ("norm", ("norm", "rms")), ("gemm (float)", ("gemm", "gemv", "nvjet", "cutlass", "sm90")),
            ("copy / cat / index", ("copy", "cat", "index", "gather", "scatter")),
            ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce")))


def exclusive_us(spans: list[tuple[float, float]]) -> list[float]:
    """Each interval's time not covered by intervals that started before it (spans sorted by start): with
    programmatic launches a kernel starts while its predecessor runs and waits for it, so that time is the
    predecessor's."""
    out, covered = [], float("-inf")
    for s, e in spans:
        out.append(max(0.0, e - max(s, covered)))
        covered = max(covered, e)
    return out


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    return sum(exclusive_us(sorted(intervals)))


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    if len(sys.argv) > 2:
        from flashdraft.engine.model_prep import resolve_plan
        from flashdraft.models import load_model

        loaded = load_model(sys.argv[2], device=dev, dtype=torch.bfloat16, context_size=1024,
                            plan=resolve_plan(dev, block_size=16))
        target, drafter, info = loaded.target, None, {"file": sys.argv[2]}
    else:
        run = gguf_run.Run(out, 600.0, False)
        target, drafter, info = gguf_run.build_models(run, dev, torch.bfloat16, gen, 1024, False, "Q5_K")
    result = {"info": {k: v for k, v in info.items() if isinstance(v, (int, float, str))}}
    # last, with a drafter: its graphed pass again with its layers on the compiled module path instead of
    # quant_forward (a drafter's rows need no batch invariance): is quant_forward what made DFlash slower?
    variants = [(True, ""), (False, "")] + ([(True, "module-path ")] if drafter is not None else [])
    for graphs, label in variants:
        if label:
            for layer in drafter.layers:
                layer.fused_rows = 0
        engine = Engine(target, None, drafter, context_size=1024, cuda_graphs=graphs)  # compiled layers on CUDA
        seq = engine.new_sequence()
        engine._sequence = seq
        prompt = list(range(10, 42))
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        engine.generate(prompt, params, 0)
        decoder = engine.decoder
        decoder.prefill(seq, prompt, params, 0)
        start = len(prompt)
        steps = [("step T=1", 1), ("step T=16", 16)] + ([("draft pass", 0)] if drafter is not None else [])
        if label:
            steps = [(label + "draft pass", 0)]
        for name, t_len in steps + ([] if graphs else [("prefill T=512", 512)]):
            tokens = torch.arange(1, t_len + 1, device=dev)
            step = lambda: decoder.target_pass(seq, tokens, start)  # noqa: E731
            if t_len > 16:  # as a prefill pass runs: the last row's logits only
                row = torch.tensor([t_len - 1], device=dev)
                step = lambda: decoder.target(tokens, decoder._positions(start, t_len), seq.target_cache,  # noqa: E731
                                              start + t_len, decoder.tap_ids, logits_row=row, causal=True)
            if t_len == 0:  # the drafter's pass of a DFlash step, five accepted rows' context projected first
                def step():
                    seq.state.ctx_rows.fill_(5)
                    return decoder.draft(seq, decoder.block_size - 1)
            with torch.inference_mode():
                for _ in range(3):
                    step()
            torch.cuda.synchronize()
            if graphs:
                ms = 1000 * gguf_run.median_s(step, dev, 20)
                result[f"graphed {name} ms"] = ms
                print(f"graphed {name}: {ms:.2f} ms", flush=True)
                continue
            # eager: the wall time of a pass beside its kernel time below (much more: the host is the bound)
            ms = 1000 * gguf_run.median_s(step, dev, 5)
            result[f"eager {name} wall ms"] = ms
            print(f"eager {name}: {ms:.2f} ms wall", flush=True)
            with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.inference_mode():
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            fams: dict = defaultdict(float)
            names: dict = defaultdict(float)
            counts: dict = defaultdict(int)
            kernels = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                             key=lambda ev: ev.time_range.start)
            own = exclusive_us([(ev.time_range.start, ev.time_range.end) for ev in kernels])
            for ev, us in zip(kernels, own):  # each kernel's own time (a programmatic launch's wait is not)
                fams[family(ev.name)] += us / 3
                names[ev.name[:90]] += us / 3
                counts[family(ev.name)] += 1
            total = sum(fams.values())
            print(f"eager {name}: kernel time {total / 1000:.2f} ms in {sum(counts.values()) // 3} kernels",
                  flush=True)
            for fam, us in sorted(fams.items(), key=lambda kv: -kv[1]):
                print(f"  {fam:22s} {us / 1000:7.2f} ms  {counts[fam] // 3:5d} kernels", flush=True)
            print("  top kernels:", flush=True)
            for kernel, us in sorted(names.items(), key=lambda kv: -kv[1])[:14]:
                print(f"    {us / 1000:7.3f} ms  {kernel}", flush=True)
            top = sorted(names.items(), key=lambda kv: -kv[1])[:30]
            result[f"eager {name}"] = {"kernel_ms": total / 1000, "families_ms": {k: v / 1000 for k, v in fams.items()},
                                         "kernels": {k: v // 3 for k, v in counts.items()},
                                         "top": {k: v / 1000 for k, v in top}}
        del engine, seq
        torch.cuda.empty_cache()
    (out / "gguf_profile.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
