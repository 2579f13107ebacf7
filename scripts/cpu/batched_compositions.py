"""How many new compositions a server's batched steps meet (issue #23): on a GPU each composition of a batched step
(its sequences, each one's draft length and rows, the cache buckets it reads) is a CUDA graph, captured the first
time it runs. This CPU has no graphs, so the server here logs the key each batched step would replay (the cache
rows it reads, SpeculativeDecoder._batch_reads, and each step's sequence, length, rows and projection), while
`flashdraft bench --concurrency NP` runs against it; then it prints, for the DFlash rounds, how many had a
composition not seen before, and the commonest draft lengths.

Usage: python scripts/cpu/batched_compositions.py SRC_DIR PORT OUT.json [NP] [PROMPTS]
  (SRC_DIR: the src/ folder to import flashdraft from; NP 4, PROMPTS code; OUT.json: every round's key)
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter


def serve(port: str, out: str, slots: str) -> None:
    """The server, each batched step's graph key logged (written to `out` when the server is stopped)."""
    from flashdraft.cli import main
    from flashdraft.engine import speculative

    log, run_batched = [], speculative.SpeculativeDecoder._run_batched

    def logged(self, steps):
        log.append([*self._batch_reads(steps)] + [[id(d.seq.target_cache), d.n, d.T, bool(d.project)] for d in steps])
        return run_batched(self, steps)

    def dump():
        with open(out, "w") as f:
            json.dump(log, f)

    speculative.SpeculativeDecoder._run_batched = logged
    atexit.register(dump)  # the server exits on SIGTERM (its own handler)
    main(["serve", "-np", slots, "--port", port])


def report(out: str) -> None:
    with open(out) as f:
        log = json.load(f)
    drafting = [i for i, e in enumerate(log) if any(step[1] > 0 for step in e[2:])]
    rounds = log[drafting[0]:] if drafting else []
    seen, new = set(), 0
    for e in rounds:
        key = (e[0], e[1], tuple(tuple(step) for step in e[2:]))
        new += key not in seen
        seen.add(key)
    lengths = Counter(tuple(step[1] for step in e[2:]) for e in rounds)
    print(f"rounds from the first drafting one: {len(rounds)}, with a composition not seen before: {new}")
    print("draft lengths by round:", ", ".join(f"{k}: {v}" for k, v in lengths.most_common(10)))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(*sys.argv[2:5])
        return 0
    src, port, out = sys.argv[1:4]
    slots = sys.argv[4] if len(sys.argv) > 4 else "4"
    prompts = sys.argv[5] if len(sys.argv) > 5 else "code"
    env = dict(os.environ, PYTHONPATH=src)
    server = subprocess.Popen([sys.executable, __file__, "--serve", port, out, slots], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                if b"ok" in urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read():
                    break
            except OSError:
                time.sleep(1)
        subprocess.run([sys.executable, "-m", "flashdraft.cli", "bench", "--url", f"http://127.0.0.1:{port}",
                        "--concurrency", slots, "-n", "128", "--reps", "1", "--prompts", prompts], env=env, check=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
