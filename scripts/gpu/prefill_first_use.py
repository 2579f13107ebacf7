"""What a prompt of a new length pays the first time (issue #24: about 100 ms in process on the demo pair, 2026-12-03):
the engine warmed up as the server warms it, then prompts of new lengths, each timed, with torch.compile's
recompilations counted and the slowest ops of the first new length profiled.

    TORCH_LOGS=recompiles python scripts/gpu/prefill_first_use.py [--no-drafter]
"""
from __future__ import annotations

import sys
import time

import torch
from torch._dynamo.utils import counters

from flashdraft.config import SamplingParams
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.generator import Engine


def main() -> int:
    drafter = None if "--no-drafter" in sys.argv else DEMO_DIR / "drafter"
    engine = Engine.load(DEMO_DIR / "target", drafter, context_size=4096)
    engine.warm_up(sampling=[SamplingParams(temperature=0.7, top_k=64, top_p=0.95)])
    params = SamplingParams(max_tokens=1)
    for n in (100, 100, 37, 250, 37, 251, 512):
        frames = counters["stats"]["unique_graphs"]
        prompt = [10 + (7 * i + n) % 8000 for i in range(n)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if n == 250:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.generate(prompt, params, 0, sequence=engine.new_sequence())
        else:
            engine.generate(prompt, params, 0, sequence=engine.new_sequence())
        torch.cuda.synchronize()
        print(f"{n:4d} tokens: {1000 * (time.perf_counter() - t0):7.1f} ms, new compiled graphs "
              f"{counters['stats']['unique_graphs'] - frames}", flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
