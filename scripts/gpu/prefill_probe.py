"""Where an eager prefill pass of a GGUF model spends its time: the host or the GPU (issue #18: Qwen3-8B Q4_K_M's
pp512 at 0.65x llama.cpp's, a 512-token pass as long as a 2048-token one; docs/performance.md).

For each pass length: the engine's prefill (prompt_ms of generate with one token), then one target pass alone,
timed three ways: the host's time to enqueue it (until the call returns), its wall time (to a synchronize), and
its kernel time (profiler); then cProfile of one enqueue (where the host's time goes) and dynamo's counters
(recompiles, graph breaks). Then Engine.warm_up (as the server runs at load) and the prefills again.

Usage (GPU machine, repo root): TORCH_LOGS=recompiles,graph_breaks PYTHONPATH=src \
    python scripts/gpu/prefill_probe.py FILE.gguf OUT [--lengths 16,512,2048]
Writes OUT/prefill_probe.json and OUT/prefill_probe_cprofile.txt.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side_gguf import prompt_of  # noqa: E402  (the side by side's prompts: random ids of a seed)

from flashdraft.config import SamplingParams  # noqa: E402
from flashdraft.engine.generator import Engine  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill_ms(engine: Engine, n: int, runs: int = 3) -> list[float]:
    vocab = engine.decoder.target.config.vocab_size
    return [round(engine.generate(prompt_of(n, vocab, seed=n), SamplingParams(max_tokens=1, ignore_eos=True), 0)
                  .stats.prompt_ms, 2) for _ in range(runs)]


def one_pass(engine: Engine, rows: int):
    """A callable running the target's pass over `rows` tokens from position 0, as a prefill pass runs."""
    decoder = engine.decoder
    seq = engine.new_sequence()
    dev = decoder.device
    tokens = torch.arange(1, rows + 1, device=dev)
    positions = decoder._positions(0, rows)
    last = torch.tensor([rows - 1], device=dev)
    return lambda: decoder.target(tokens, positions, seq.target_cache, rows, decoder.tap_ids, logits_row=last,
                                  causal=True)


def pass_times(run, reps: int = 5) -> dict:
    enqueue, wall = [], []
    with torch.inference_mode():
        for _ in range(2):
            run()
        sync()
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            enqueue.append(1000 * (t1 - t0))
            wall.append(1000 * (t2 - t0))
        activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            run()
            sync()
    kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    return {"enqueue_ms": round(sorted(enqueue)[reps // 2], 2), "wall_ms": round(sorted(wall)[reps // 2], 2),
            "kernel_ms": round(sum(ev.device_time_total for ev in kernels) / 1000, 2), "kernels": len(kernels)}


def host_profile(run) -> str:
    with torch.inference_mode():
        run()
        sync()
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def dynamo_counters() -> dict:
    from torch._dynamo.utils import counters
    return {name: dict(values) for name, values in counters.items() if values}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", default="16,512,2048")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    result: dict = {"file": str(args.file), "torch": torch.__version__}
    t = time.time()
    engine = Engine.load(args.file, device=torch.device(args.device), context_size=max(lengths) + 1024)
    result["load_s"] = round(time.time() - t, 1)
    save = lambda: (args.out / "prefill_probe.json").write_text(json.dumps(result, indent=1))  # noqa: E731
    profiles = []
    for n in lengths:
        result[f"prefill {n} ms, before warm_up"] = prefill_ms(engine, n)
        print(f"prefill {n}: {result[f'prefill {n} ms, before warm_up']} ms", flush=True)
        run = one_pass(engine, n)
        result[f"pass {n}"] = pass_times(run)
        print(f"pass {n}: {result[f'pass {n}']}", flush=True)
        profiles.append(f"===== pass of {n} rows: one enqueue =====\n{host_profile(run)}")
        save()
    result["dynamo counters before warm_up"] = dynamo_counters()
    (args.out / "prefill_probe_cprofile.txt").write_text("\n".join(profiles))
    t = time.time()
    engine.warm_up()
    result["warm_up_s"] = round(time.time() - t, 1)
    print(f"warm_up: {result['warm_up_s']} s", flush=True)
    for n in lengths:
        result[f"prefill {n} ms, after warm_up"] = prefill_ms(engine, n)
        print(f"prefill {n} after warm_up: {result[f'prefill {n} ms, after warm_up']} ms", flush=True)
    result["dynamo counters at the end"] = dynamo_counters()
    save()
    print(json.dumps(result["dynamo counters at the end"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
