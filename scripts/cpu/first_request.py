"""The first requests after a server start against later ones: `flashdraft serve` on the embedded demo pair (CPU),
three chat requests of the walkthrough's kind (T 0.7, top-k 64, top-p 0.95, 120 tokens) with different prompts,
each request's prompt time, decode speed and wall time from its `timings`. The load time says what a warm-up at
load costs. Pass --no-warmup to start the server without it.

    PYTHONPATH=src python scripts/cpu/first_request.py [--no-warmup]
"""
from __future__ import annotations

import sys
import time

import httpx

from flashdraft.demo import demo_paths
from flashdraft.server.app import ServerState
from flashdraft.server.cli import serve_in_thread
from flashdraft.server.settings import ServerSettings

QUESTIONS = ["Write a Python function that reverses a string.", "Write a Python class for a bank account.",
             "Write a Python function that merges two sorted lists."]


def main() -> int:
    target, drafter = demo_paths()
    started = time.perf_counter()
    state = ServerState(ServerSettings(model=str(target), drafter=str(drafter), alias=None, ctx_size=2048,
                                       api_keys=[], device="cpu", warmup="--no-warmup" not in sys.argv))
    state.load(on_failure=lambda: None)
    loaded = time.perf_counter() - started
    server, base = serve_in_thread(state)
    url = base + "/v1/chat/completions"
    print(f"loaded in {loaded:.2f} s ({'no warm-up' if '--no-warmup' in sys.argv else 'with the warm-up'})")
    with httpx.Client(timeout=120) as client:
        for i, question in enumerate(QUESTIONS, 1):
            body = {"messages": [{"role": "user", "content": question}], "max_tokens": 120, "temperature": 0.7,
                    "top_k": 64, "top_p": 0.95, "seed": i}
            t = time.perf_counter()
            timings = client.post(url, json=body).json()["timings"]
            print(f"request {i}: prompt {timings['prompt_n']} tokens in {timings['prompt_ms']:.0f} ms, "
                  f"{timings['predicted_n']} tokens at {timings['predicted_per_second']:.0f} tok/s, "
                  f"wall {1000 * (time.perf_counter() - t):.0f} ms")
    server.handle_exit(15, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
