"""Where a DFlash step's time goes on a GGUF target (issue #18: DFlash asks 4x llama.cpp's plain decoding; the
Qwen3-8B Q4_K_M step is ~7.0 ms at tau 5.77, of which the 16-row verify is ~5.0): one profiled generation of
128 tokens after a 512-token prompt, as side_by_side_gguf.py's DFlash row runs it (the same random drafter, the
planted oracle at tau 6, graphs and pipelined steps), and the same for plain decoding with the drafter loaded.
For each: wall time a step, the GPU's kernel time a step (the union of kernel intervals in the decode window, so
overlap is not counted twice), the idle time between, each kernel's own time (what the kernels that started
before it do not cover) by family and by kernel, and two steps' kernels in order.

Usage (GPU machine, repo root): PYTHONPATH=src:$SITE python scripts/gpu/dflash_profile.py FILE.gguf OUT
[--prompt 512] [--tokens 128] [--drafter Q5_K|bf16]. OUT/dflash_profile.json gets the figures.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_profile import busy_us, exclusive_us, family  # noqa: E402
from side_by_side_gguf import build_drafter, context_for, decode_tok_s, prompt_of  # noqa: E402

from flashdraft.bench.oracle import PlantedOracle  # noqa: E402
from flashdraft.config import SamplingParams  # noqa: E402
from flashdraft.engine.generator import Engine  # noqa: E402


def profiled(engine: Engine, prompt: list[int], tokens: int, draft: int, sequence) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.generate(prompt, params, draft, sequence)  # warm-up: every capture this length meets
    unprofiled = engine.generate(prompt, params, draft, sequence)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = engine.generate(prompt, params, draft, sequence)
        torch.cuda.synchronize()
    kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda ev: ev.time_range.start)
    # the decode window: the last predicted_ms of the kernels' span (the decode phase ends the run)
    spans = [(ev.time_range.start, ev.time_range.end) for ev in kernels]
    t0, t1 = spans[0][0], max(e for _, e in spans)
    decode_from = t1 - out.stats.predicted_ms * 1000
    window = [(max(s, decode_from), e) for s, e in spans if e > decode_from]
    steps = out.stats.steps if draft else out.stats.predicted_n - 1
    fams: dict = defaultdict(float)
    names: dict = defaultdict(float)
    counts: dict = defaultdict(int)
    own = exclusive_us(spans)
    for ev, (s, e), us in zip(kernels, spans, own):
        if s < decode_from:
            continue
        fams[family(ev.name)] += us / steps
        names[ev.name[:100]] += us / steps
        counts[ev.name[:100]] += 1
    busy = busy_us(window)
    # two steps' kernels in order from the middle of the decode window: start offset, duration, own time, name
    mid = (decode_from + t1) / 2
    wall = out.stats.predicted_ms * 1000 / steps
    timeline = [(round(s - mid, 1), round(e - s, 1), round(us, 1), ev.name[:70])
                for ev, (s, e), us in zip(kernels, spans, own) if mid <= s < mid + 2 * wall]
    return {"tok_s": decode_tok_s(out), "tok_s_unprofiled": decode_tok_s(unprofiled),
            "tau": out.stats.tau if draft else 1.0, "steps": steps,
            "decode_ms": out.stats.predicted_ms, "prompt_ms": out.stats.prompt_ms,
            "wall_us_per_step": out.stats.predicted_ms * 1000 / steps, "busy_us_per_step": busy / steps,
            "idle_us_per_step": (out.stats.predicted_ms * 1000 - busy) / steps,
            "kernels_per_step": sum(counts.values()) / steps,
            "families_us_per_step": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
            "top_us_per_step": dict(sorted(names.items(), key=lambda kv: -kv[1])[:40]),
            "calls_per_step": {k: counts[k] / steps for k in sorted(names, key=lambda k: -names[k])[:40]},
            "span_ms": (t1 - t0) / 1000, "timeline": timeline, "tokens": out.tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafter", default="Q5_K", choices=("Q5_K", "bf16"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    context = context_for(args.prompt, args.tokens)
    engine = Engine.load(args.file, device=dev, context_size=context)
    target = engine.decoder.target
    gen = torch.Generator(device=dev).manual_seed(0)
    drafter = build_drafter(target, context + 64, args.drafter, False, dev, target.model.norm.weight.dtype, gen)
    spec = Engine(target, engine.tokenizer, drafter, context_size=context)
    del engine
    prompt = prompt_of(args.prompt, target.config.vocab_size, seed=args.prompt)
    result = {"file": str(args.file), "device": torch.cuda.get_device_name(dev), "prompt": args.prompt}
    plain = profiled(spec, prompt, args.tokens, 0, spec.new_sequence())
    B = drafter.block_size
    oracle = PlantedOracle(prompt + plain["tokens"], lambda s: 5, target.config.vocab_size, dev)  # tau 6
    dflash = profiled(spec, prompt, args.tokens, B - 1, spec.new_sequence(oracle=oracle))
    dflash["identical"] = dflash["tokens"] == plain["tokens"]
    for name, r in (("plain", plain), ("dflash", dflash)):
        r.pop("tokens")
        result[name] = r
        print(f"{name}: {r['tok_s']:.1f} tok/s ({r['tok_s_unprofiled']:.1f} unprofiled), tau {r['tau']:.2f}, "
              f"{r['steps']} steps: wall "
              f"{r['wall_us_per_step']:.0f} us a step, GPU busy {r['busy_us_per_step']:.0f}, idle "
              f"{r['idle_us_per_step']:.0f}, {r['kernels_per_step']:.0f} kernels", flush=True)
        for fam, us in r["families_us_per_step"].items():
            print(f"  {fam:22s} {us:8.1f} us", flush=True)
        print("  top kernels (us a step, calls a step):", flush=True)
        for k, us in list(r["top_us_per_step"].items())[:25]:
            print(f"    {us:8.1f}  {r['calls_per_step'][k]:6.1f}  {k}", flush=True)
    print(f"DFlash tokens identical to plain: {dflash['identical']}", flush=True)
    (args.out / "dflash_profile.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
