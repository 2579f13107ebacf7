"""Where Engine.warm_up's time goes: each stage timed (a prompt of each prefill bucket, the passes over a prefix, the
steps) and dynamo's count of compiled graphs, for a model file or folder, with the layers compiled as on a GPU
(compile=True, prompt passes padded to buckets) even on a CPU. Run it twice with the same TORCHINDUCTOR_CACHE_DIR
to see a later start's cost (the compiled code from the on-disk cache).

Usage: PYTHONPATH=src python scripts/cpu/warmup_cost.py MODEL [--device cpu] [--context 4096]
e.g. a tiny Gemma 4 GGUF: python ../shared/llamacpp-bench/make_gguf.py --shape tiny-gemma4 --type q4_k_s -o /tmp/g.gguf
"""
from __future__ import annotations

import argparse
import time

import torch
from torch._dynamo.utils import counters

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.engine.model_prep import resolve_plan
from flashdraft.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    loaded = load_model(args.model, device=dev, dtype=dtype, context_size=args.context,
                        plan=resolve_plan(dev, compile=True, block_size=16))
    engine = Engine(loaded.target, loaded.tokenizer, None, context_size=loaded.context_size, compile=True,
                    pad_prefill=True)
    decoder, sequence = engine.decoder, engine.new_sequence()
    stages = [(f"prompt of {size}", lambda size=size: decoder.prefill(
        sequence, engine._made_up_prompt(size), SamplingParams(), seed=0, capture_graphs=True))
        for size in decoder.prefill_buckets if size < engine.context_size]
    stages += [("passes over a prefix", lambda: engine._warm_up_passes_over_a_prefix(sequence)),
               ("steps", lambda: engine._warm_up_steps(sequence, []))]
    total = 0.0
    for name, stage in stages:
        t = time.perf_counter()
        stage()
        total += time.perf_counter() - t
        print(f"{name:>22}: {time.perf_counter() - t:7.2f} s", flush=True)
    print(f"{'all':>22}: {total:7.2f} s; compiled graphs: {counters['stats'].get('unique_graphs', 0)}")


if __name__ == "__main__":
    main()
