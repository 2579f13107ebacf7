"""Two conversations taking turns on one slot (demo pair, CPU): prompt time per turn with the host prompt cache
(--cache-ram) and without it (medians of --reps).

    python scripts/cpu/prompt_cache_turns.py [--reps 3] [--max-tokens 48]

Conversations A and B alternate, four turns each, on one sequence, as `flashdraft serve -np 1` runs them: with
the cache, the slot's prefix is saved before the other conversation's prompt overwrites it and restored when
its conversation comes back (as the scheduler does); without it, each turn reuses only what the other
conversation's prompt shares with it. Every output is checked against a cold run. The save and restore
copies happen before a turn's prefill and are timed apart from its prompt_ms.
"""
from __future__ import annotations

import argparse
import statistics
import time

from flashdraft.config import SamplingParams
from flashdraft.demo import DEMO_DIR
from flashdraft.engine.generator import Engine
from flashdraft.server.scheduler import PromptCache

CONVERSATIONS = {
    "A": ["Write a function that parses a CSV line.", "Now add type hints.", "Add a docstring.",
          "Write a test for it."],
    "B": ["Write a class for a bounded queue.", "Add a method that peeks at the head.", "Make it thread safe.",
          "Write a test for it."],
}


def last(events):
    *_, result = events
    return result


def run_turns(engine: Engine, params: SamplingParams, cache: PromptCache | None) -> list[tuple]:
    slot = engine.new_sequence()
    history = {name: [] for name in CONVERSATIONS}
    rows = []
    for turn in range(4):
        for name, turns in CONVERSATIONS.items():
            history[name].append({"role": "user", "content": turns[turn]})
            prompt = engine.encode_prompt(messages=history[name])
            copy_ms = 0.0
            if cache is not None:
                start = time.perf_counter()
                cache.save(slot)
                cache.restore(slot, prompt, engine.decoder.reusable_rows(slot, prompt))
                copy_ms = 1000 * (time.perf_counter() - start)
            warm = last(engine.stream(prompt, params, sequence=slot, reuse_prefix=True))
            cold = last(engine.stream(prompt, params, sequence=engine.new_sequence()))
            assert warm.tokens == cold.tokens, f"{name} turn {turn + 1}: warm and cold outputs differ"
            rows.append((f"{name}{turn + 1}", len(prompt), warm.stats.cache_n, warm.stats.prompt_ms, copy_ms))
            history[name].append({"role": "assistant", "content": warm.text})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    engine = Engine.load(DEMO_DIR / "target", DEMO_DIR / "drafter", device="cpu")
    params = SamplingParams(max_tokens=args.max_tokens)
    results = {"on": [], "off": []}
    for rep in range(args.reps + 1):  # the first round warms up
        for mode, runs in results.items():
            cache = PromptCache(engine.decoder, 8192 << 20) if mode == "on" else None
            rows = run_turns(engine, params, cache)
            if rep:
                runs.append(rows)
    print("| turn | prompt tokens | cached, cache on | prompt_ms, cache on | save + restore ms | cached, off | "
          "prompt_ms, off |")
    print("|---|---|---|---|---|---|---|")
    for i, (name, n, *_) in enumerate(results["on"][0]):
        on = [r[i] for r in results["on"]]
        off = [r[i] for r in results["off"]]
        print(f"| {name} | {n} | {on[0][2]} | {statistics.median(r[3] for r in on):.1f} | "
              f"{statistics.median(r[4] for r in on):.1f} | {off[0][2]} | {statistics.median(r[3] for r in off):.1f} |")


if __name__ == "__main__":
    main()
