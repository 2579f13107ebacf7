"""Prompt time per turn of a 5-turn chat on the demo pair, with prefix reuse and cold (medians of --reps).

    python scripts/cpu/multiturn_prefix.py [--reps 3] [--max-tokens 64]

Each turn's prompt is the chat so far (the model's replies fed back through the template); "warm" runs it on
the sequence that ran the previous turn (Engine.stream(reuse_prefix=True)), "cold" on a fresh one.
"""
from __future__ import annotations

import argparse
import statistics

from flashdraft.config import SamplingParams
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.generator import Engine

TURNS = ["Write a function that parses a CSV line.", "Now add type hints.", "Add a docstring.",
         "Write a test for it.", "Make it handle quoted fields."]


def last(events):
    *_, result = events
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    engine = Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu")
    params = SamplingParams(max_tokens=args.max_tokens)
    rows = {}
    for rep in range(args.reps + 1):  # the first round warms up
        warm_seq = engine.new_sequence()
        messages = []
        for turn, text in enumerate(TURNS, 1):
            messages.append({"role": "user", "content": text})
            prompt = engine.encode_prompt(messages=messages)
            warm = last(engine.stream(prompt, params, sequence=warm_seq, reuse_prefix=True))
            cold = last(engine.stream(prompt, params, sequence=engine.new_sequence()))
            assert warm.tokens == cold.tokens, f"turn {turn}: warm and cold outputs differ"
            if rep:
                rows.setdefault(turn, []).append((len(prompt), warm.stats.cache_n, warm.stats.prompt_ms,
                                                  cold.stats.prompt_ms))
            messages.append({"role": "assistant", "content": warm.text})
    print("| turn | prompt tokens | cached | warm prompt_ms | cold prompt_ms | warm / cold |")
    print("|---|---|---|---|---|---|")
    for turn, runs in rows.items():
        warm_ms = statistics.median(r[2] for r in runs)
        cold_ms = statistics.median(r[3] for r in runs)
        print(f"| {turn} | {runs[0][0]} | {runs[0][1]} | {warm_ms:.1f} | {cold_ms:.1f} | {warm_ms / cold_ms:.0%} |")


if __name__ == "__main__":
    main()
