"""The DFlash walkthrough's benchmark client: its three code prompts against a running server, one at a time.

Sends each prompt to /v1/chat/completions as the walkthrough does (max_tokens 1200, temperature 0.7, top-k 64,
top-p 0.95, min-p 0) and prints, per prompt and in all, the server's own figures from llama.cpp's `timings`:
tokens generated, decode tok/s, the drafter's proposed / accepted tokens, and the prompt's processing time (the
first request's shows what a server start leaves to the first request). The requests use only llama-server's
API, so the same client measures flashdraft or llama-server.

    flashdraft serve --spec-type dflash -c 32768 --temp 0.7 --top-k 64 --top-p 0.95 --min-p 0.0 --port 8080
    python scripts/walkthrough/client.py --url http://127.0.0.1:8080
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from flashdraft.bench.prompts import CODE

PROMPTS = {p.name: p.messages[-1]["content"] for p in CODE}  # the walkthrough's three prompts


def ask(url: str, prompt: str, max_tokens: int, api_key: str | None, timeout: float) -> dict:
    body = {"model": "any", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.7, "top_k": 64, "top_p": 0.95, "min_p": 0.0}
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def row(name: str, t: dict) -> str:
    drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
    rate = f"{100 * accepted / drafted:.1f}%" if drafted else "-"
    speed = 1000 * t["predicted_n"] / t["predicted_ms"] if t["predicted_ms"] else 0.0
    prompt = f"{t['prompt_ms']:.1f}" if t.get("prompt_ms") is not None else "-"
    return f"{name:<12} {t['predicted_n']:>6} {speed:>9.1f} {drafted:>8} {accepted:>9} {rate:>7} {prompt:>10}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default http://127.0.0.1:8080)")
    p.add_argument("--max-tokens", type=int, default=1200, help="tokens per reply (default 1200, the walkthrough's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600, help="seconds per request (default 600)")
    args = p.parse_args(argv)
    print(f"{'prompt':<12} {'tokens':>6} {'tok/s':>9} {'drafted':>8} {'accepted':>9} {'rate':>7} {'prompt ms':>10}")
    total = {"predicted_n": 0, "predicted_ms": 0.0, "draft_n": 0, "draft_n_accepted": 0, "prompt_ms": 0.0}
    for name, prompt in PROMPTS.items():
        try:
            reply = ask(args.url, prompt, args.max_tokens, args.api_key, args.timeout)
        except urllib.error.HTTPError as e:
            print(f"{name}: HTTP {e.code}: {e.read().decode(errors='replace')}", file=sys.stderr)
            return 1
        except (urllib.error.URLError, TimeoutError) as e:
            print(f"{name}: cannot reach {args.url}: {e}", file=sys.stderr)
            return 1
        t = reply.get("timings")
        if not t:
            print(f"{name}: the reply has no timings object", file=sys.stderr)
            return 1
        print(row(name, t))
        for key in total:
            total[key] += t.get(key, 0)
    print(row("all", total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
