"""Per-request time of a server whose prompt cache fills up with prefixes that share a long start: N chat requests
on one slot (a tiny random Qwen3-shaped model on the CPU, so the model costs little), each the same 8 sentences and
a different number, one token each; every request leaves the previous prompt's prefix in the prompt cache, which
the next one compares with its own tokens (shared_prefix). Prints the median client wall time and the median of
the server's prompt_ms.

    PYTHONPATH=src:tests python scripts/cpu/shared_prefix_requests.py [N]
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tiny_models import build_target


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    target = build_target(Path(tempfile.mkdtemp()) / "t", family="qwen3", seed=1)
    sock_port = 18777
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", "serve", "--port", str(sock_port), "-m",
                             str(target), "-c", "512", "-t", "1", "-np", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{sock_port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        content = "Write a function that adds two numbers. " * 8
        walls, prompt_ms = [], []
        with httpx.Client() as client:
            for i in range(n):
                body = {"messages": [{"role": "user", "content": content + str(i)}], "max_tokens": 1}
                t = time.perf_counter()
                timings = client.post(url + "/v1/chat/completions", json=body, timeout=60).json()["timings"]
                walls.append((time.perf_counter() - t) * 1000)
                prompt_ms.append(timings["prompt_ms"])
        print(f"{n} requests: wall {statistics.median(walls):.1f} ms (median), prompt_ms "
              f"{statistics.median(prompt_ms):.1f} ms (median), {timings['prompt_n']} prompt tokens processed each")
    finally:
        proc.terminate()
        proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
