"""What the server adds per token, where the model costs next to nothing: a tiny random Qwen3-shaped model (the
tests' builder, 4 layers of 64) on the CPU, plain greedy decoding of N tokens in process (Engine.stream) and through
`flashdraft serve` in its own process (a streamed /v1/chat/completions of the same chat, ignore_eos; the client's
wall time); the difference per token is the scheduler's, the response formatting's and the HTTP stream's. On a GPU a small model's step takes about
0.2 ms, so host work of this size decides its serving speed (issue #24).

    PYTHONPATH=src:tests python scripts/cpu/server_overhead.py [N] [--drafter] [--pid]   (--pid: print the
    server's pid, wait 2 s, then stream 12 times instead of 3, for py-spy)
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine, GenerationResult
from tiny_models import build_drafter, build_target


def main() -> int:
    n = int(next((a for a in sys.argv[1:] if a.isdigit()), 400))
    with_drafter = "--drafter" in sys.argv
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp())
    target = build_target(folder / "t", family="qwen3", seed=1)
    drafter = build_drafter(folder / "d", target, block_size=8, seed=2) if with_drafter else None
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]

    engine = Engine.load(target, drafter, device="cpu", context_size=512)
    ids = engine.tokenizer.encode_chat(messages)
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    in_process = []
    for _ in range(3):
        started = time.perf_counter()
        result = [e for e in engine.stream(ids, params, draft=0) if isinstance(e, GenerationResult)][-1]
        in_process.append(result.stats.predicted_n / (time.perf_counter() - started))

    port = 8000 + int.from_bytes(__import__("os").urandom(1), "little")
    command = [sys.executable, "-m", "flashdraft.cli", "serve", "-m", str(target), "--port", str(port), "--device",
               "cpu", "-c", "512", "--threads", "1", "--no-warmup"]
    command += ["-md", str(drafter), "--spec-type", "none"] if drafter else []
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    served, chunks = [], 0
    body = {"messages": messages, "max_tokens": n, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=120) as client:
            while True:
                try:
                    if client.get(base + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            if "--pid" in sys.argv:
                print(f"server pid {server.pid}", flush=True)
                time.sleep(2)
            for _ in range(12 if "--pid" in sys.argv else 3):
                started, chunks, predicted = time.perf_counter(), 0, 0
                with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            timings = json.loads(line[6:]).get("timings") or {}
                            predicted = timings.get("predicted_n", 0)
                served.append(predicted / (time.perf_counter() - started))
    finally:
        server.terminate()
        server.wait()
    a, b = statistics.median(in_process), statistics.median(served)
    print(f"{n} tokens, plain greedy, tiny model on the CPU, 1 thread{' (drafter loaded)' if drafter else ''}")
    print(f"in process: {a:.0f} tok/s ({1e6 / a:.0f} us a token); runs {', '.join(f'{x:.0f}' for x in in_process)}")
    print(f"served (streamed, client's wall): {b:.0f} tok/s ({1e6 / b:.0f} us a token); runs "
          f"{', '.join(f'{x:.0f}' for x in served)}; {chunks} data chunks")
    print(f"the server adds {1e6 / b - 1e6 / a:.0f} us a token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
