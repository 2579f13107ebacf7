"""Decode speed of the embedded demo pair on this machine: plain (drafter loaded, draft 0), greedy DFlash and the
walkthrough's sampling (T 0.7, top-k 64, top-p 0.95, adaptive drafting), a 200-token code answer each, the
median of 3 after a warm-up. Run it for two checkouts in turn to compare them on a noisy machine:

    PYTHONPATH=src python scripts/cpu/demo_speed.py
"""
import torch

from flashdraft.config import SamplingParams
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.generator import Engine

torch.set_num_threads(2)
engine = Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu")
prompt = engine.encode_prompt(messages=[{"role": "user", "content": "Write a Python class Stack with push, pop, "
                                                                  "peek and is_empty, and tests for each."}])
cases = {"plain": (SamplingParams(max_tokens=200, ignore_eos=True), 0),
         "dflash": (SamplingParams(max_tokens=200, ignore_eos=True), None),
         "dflash-T0.7": (SamplingParams(max_tokens=200, temperature=0.7, top_k=64, top_p=0.95, seed=1,
                                        ignore_eos=True), None)}
for name, (params, draft) in cases.items():
    engine.generate(prompt, params, draft)
    runs = []
    for _ in range(3):
        out = engine.generate(prompt, params, draft)
        runs.append(out.stats.predicted_n / (out.stats.predicted_ms / 1000))
    runs.sort()
    print(f"{name}: median {runs[1]:.1f} tok/s (min {runs[0]:.1f} max {runs[2]:.1f}), tau {out.stats.tau:.2f}")
