"""Decode speed through `flashdraft serve` against the engine's own loop for the very same requests (issue #24:
within 5%).

The walkthrough's three code prompts, chat-templated once by the engine, go to /completion as token ids with the
walkthrough's sampling (T 0.7, top-k 64, top-p 0.95, min-p 0), a seed, ignore_eos and a fixed draft length (the
full block: the server runs with --no-spec-dm-adaptive), streamed; then the same ids, seeds and draft length
through Engine.stream in this process, the server stopped. Both sides then do the same work and give the same
tokens (checked), so their tok/s compare the loops alone. Per prompt: the in-process decode tok/s (median of
--reps) and the medians over the seeds of two ratios to it, seed by seed: the server's timings
(predicted_per_second) and the client's own rate (tokens after the first over the time after the first event).

Usage (GPU machine, repo root; carry .whl): PYTHONPATH=src:/tmp/site python scripts/gpu/server_vs_engine.py
    [--spec-type dflash|none] [-n 1200] [--reps 5] [--json FILE]
Also runs on a CPU with a small -n (a check of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "src" / "flashdraft" / "demo"
SAMPLING = {"temperature": 0.7, "top_k": 64, "top_p": 0.95, "min_p": 0.0}


def stream_completion(url: str, ids: list[int], n: int, seed: int, timeout: float) -> dict:
    body = {"prompt": ids, "n_predict": n, "stream": True, "seed": seed, "ignore_eos": True, "cache_prompt": False,
            "return_tokens": True, **SAMPLING}
    request = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started, first, last, tokens, timings = time.perf_counter(), None, None, [], {}
    first_tokens = 0
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            got = chunk.get("tokens") or []
            if got and first is None:
                first, first_tokens = time.perf_counter(), len(got)
            if got:
                last = time.perf_counter()
            tokens += got
            timings = chunk.get("timings") or timings
    after_first = len(tokens) - first_tokens
    client = after_first / (last - first) if first is not None and last > first else 0.0
    return {"tokens": tokens, "server_tok_s": timings.get("predicted_per_second"), "client_tok_s": client,
            "ttft_ms": 1000 * (first - started) if first else None}


def serve(spec: str, port: int, ctx: int) -> subprocess.Popen:
    drafter = ["--spec-type", spec] + ([] if spec == "none" else ["--no-spec-dm-adaptive"])
    flags = ["--temp", "0.7", "--top-k", "64", "--top-p", "0.95", "--min-p", "0.0"]
    process = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", "serve", *drafter, "-c", str(ctx), *flags,
                                "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise SystemExit(f"serve exited: {process.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return process
        except Exception:  # noqa: BLE001 - not ready yet (503 while loading, or not listening)
            if time.monotonic() > deadline:
                process.kill()
                raise SystemExit("serve did not become ready in 300 s") from None
            time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec-type", default="dflash", choices=["dflash", "none"])
    ap.add_argument("-n", type=int, default=1200, help="tokens per reply (ignore_eos)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from flashdraft.bench.prompts import CODE
    from flashdraft.config import SamplingParams
    from flashdraft.engine.generator import Engine, GenerationResult

    drafter = DEMO / "drafter" if args.spec_type == "dflash" else None
    engine = Engine.load(DEMO / "target", drafter, context_size=args.ctx_size)
    prompts = {p.name: engine.encode_prompt(messages=p.messages) for p in CODE}
    draft = engine.max_draft if drafter else 0
    del engine  # the server gets the GPU to itself; reloaded below

    url = f"http://127.0.0.1:{args.port}"
    process = serve(args.spec_type, args.port, args.ctx_size)
    served = {}
    try:
        for name, ids in prompts.items():
            stream_completion(url, ids, 32, seed=999, timeout=120)  # the prompt's length seen once, untimed
            served[name] = [stream_completion(url, ids, args.n, seed=100 + r, timeout=600) for r in range(args.reps)]
    finally:
        process.terminate()
        process.wait(30)

    engine = Engine.load(DEMO / "target", drafter, context_size=args.ctx_size)
    engine.warm_up(sampling=[SamplingParams(**SAMPLING)])
    local = {}
    for name, ids in prompts.items():
        engine.generate(ids, SamplingParams(max_tokens=32, seed=999, ignore_eos=True, **SAMPLING), draft)
        runs = []
        for r in range(args.reps):
            params = SamplingParams(max_tokens=args.n, seed=100 + r, ignore_eos=True, **SAMPLING)
            result = [e for e in engine.stream(ids, params, draft) if isinstance(e, GenerationResult)][-1]
            runs.append({"tokens": list(result.tokens), "tok_s": result.stats.predicted_per_second,
                         "tau": result.stats.tau if result.stats.draft_n else None})
        local[name] = runs

    print(f"{args.spec_type}, {args.n} tokens a reply, medians of {args.reps} (decode tok/s)")
    print(f"{'prompt':<12} {'in process':>11} {'server/in':>9} {'client/in':>9} {'tau':>5} {'same tokens':>11}")
    rows = {}
    for name in prompts:
        # ratios per seed (the same tokens on both sides), then their median: seeds differ in tau and speed
        srv = statistics.median(s["server_tok_s"] / lo["tok_s"] for s, lo in zip(served[name], local[name]))
        cli = statistics.median(s["client_tok_s"] / lo["tok_s"] for s, lo in zip(served[name], local[name]))
        loc = statistics.median(r["tok_s"] for r in local[name])
        same = all(s["tokens"] == lo["tokens"] for s, lo in zip(served[name], local[name]))
        taus = [r["tau"] for r in local[name] if r["tau"] is not None]
        tau = f"{statistics.median(taus):.2f}" if taus else "-"
        rows[name] = {"server_ratio": srv, "client_ratio": cli, "in_process_tok_s": loc, "same_tokens": same,
                      "server_runs": [r["server_tok_s"] for r in served[name]],
                      "client_runs": [r["client_tok_s"] for r in served[name]],
                      "in_process_runs": [r["tok_s"] for r in local[name]]}
        print(f"{name:<12} {loc:>11.1f} {srv:>9.3f} {cli:>9.3f} {tau:>5} {str(same):>11}")
    if args.json:
        Path(args.json).write_text(json.dumps({"spec_type": args.spec_type, "n": args.n, "reps": args.reps,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
