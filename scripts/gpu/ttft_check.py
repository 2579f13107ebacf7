"""Time to first token for new prompts of a given length, from the first request on (issue #24).

Each request is a prompt of random token ids no request before it began with (so no prefix is reused), and
one generated token. Two ways, to compare:
    python scripts/gpu/ttft_check.py --url http://127.0.0.1:8080 --lengths 100,100,37,250
        a running server: llama-server's /completion, streamed, the prompt as token ids; the time to the first event,
        beside the server's own prompt_ms
    python scripts/gpu/ttft_check.py --model PATH [--drafter PATH] --lengths 100,100,37,250
        in process: Engine.load, warmed up as `flashdraft serve` warms up, then the same prompts (prefill and
        the first token, to the host)
    python scripts/gpu/ttft_check.py --url URL --turns 5 --turn-tokens 6000 --reply-tokens 64
        a conversation (issue #21): each turn's prompt is the last turn's prompt, its reply and turn-tokens new
        tokens, sent with cache_prompt on; then the last turn's prompt once more with another first token (nothing
        reusable: a cold prefill of the whole conversation). Per turn: time to first token, prompt_n, cache_n
With --url the client first sends GET /health (timed and printed apart), so that its own first use of urllib and
of a connection is not counted in the first prompt's figure. --json FILE keeps the rows. The server's figure
includes HTTP and the scheduler; the in-process one is the prefill alone: their ratio is what the server adds to
a first token.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request


def prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """One prompt per length, each starting with a token no other starts with (ids from 10 up, below vocab)."""
    rng = random.Random(seed)
    firsts = rng.sample(range(10, vocab), len(lengths))
    return [[first] + [rng.randrange(10, vocab) for _ in range(n - 1)] for first, n in zip(firsts, lengths)]


def over_http(url: str, ids: list[int], timeout: float, max_tokens: int = 1, cache_prompt: bool = False) -> dict:
    body = {"prompt": ids, "n_predict": max_tokens, "stream": True, "temperature": 0, "cache_prompt": cache_prompt,
            "return_tokens": True}
    request = urllib.request.Request(f"{url.rstrip('/')}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started, first, timings, reply = time.perf_counter(), None, {}, []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if first is None:
                first = 1000 * (time.perf_counter() - started)
            chunk = json.loads(line[5:])
            timings = chunk.get("timings") or timings
            reply += chunk.get("tokens") or []
    return {"ttft_ms": first, "server_prompt_ms": timings.get("prompt_ms"), "prompt_n": timings.get("prompt_n"),
            "cache_n": timings.get("cache_n"), "reply": reply}


def conversation(url: str, turns: int, turn_tokens: int, reply_tokens: int, vocab: int, seed: int,
                 timeout: float) -> list[dict]:
    """A chat of `turns` turns by token ids (see the module docstring), then the cold prefill of its last prompt."""
    rng = random.Random(seed)
    prompt, rows = [], []
    for turn in range(1, turns + 1):
        prompt = prompt + [rng.randrange(10, vocab) for _ in range(turn_tokens)]
        row = over_http(url, prompt, timeout, reply_tokens, cache_prompt=True)
        rows.append({"turn": turn, "tokens": len(prompt), **row})
        prompt = prompt + row.pop("reply")
    cold = [rng.choice([t for t in range(10, 100) if t != prompt[0]])] + prompt[1:]
    row = over_http(url, cold, timeout, 1)
    row.pop("reply")
    rows.append({"turn": "cold", "tokens": len(cold), **row})
    return rows


def in_process(model: str, drafter: str | None, ctx: int | None, lengths: list[int], seed: int,
               prefill_chunk: int | None = None) -> tuple[list[dict], dict]:
    import torch

    from flashdraft.config import SamplingParams
    from flashdraft.engine.generator import Engine

    started = time.perf_counter()
    engine = Engine.load(model, drafter, context_size=ctx, prefill_chunk=prefill_chunk)
    loaded = time.perf_counter() - started
    sequence = engine.new_sequence()  # warmed up and then serving, as a server's slot (graphs are per sequence)
    warm = engine.warm_up(sequence)
    vocab = engine.decoder.target.config.vocab_size
    rows = []
    for ids in prompts(lengths, vocab, seed):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = engine.generate(ids, SamplingParams(max_tokens=1), 0, sequence=sequence)
        rows.append({"ttft_ms": 1000 * (time.perf_counter() - t0), "prompt_ms": result.stats.prompt_ms,
                     "prompt_n": result.stats.prompt_n})
    return rows, {"load_s": loaded, "warm_up_s": warm, "vocab": vocab}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--model", help="a model folder or GGUF file, in process")
    p.add_argument("--drafter", default=None, help="in process: the drafter (loaded, as a server loads it)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="in process: the context size")
    p.add_argument("-ub", "--ubatch-size", type=int, default=None, help="in process: tokens per prefill pass")
    p.add_argument("--lengths", default="100,100,100,37,250,512", help="prompt lengths in tokens, in order")
    p.add_argument("--vocab", type=int, default=8192,
                   help="with --url: token ids are drawn below this (default 8192; in process: the model's)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed (use another for each server run)")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--turns", type=int, default=0, help="with --url: a conversation of this many turns instead")
    p.add_argument("--turn-tokens", type=int, default=6000, help="new prompt tokens each turn (default 6000)")
    p.add_argument("--reply-tokens", type=int, default=64, help="tokens generated each turn (default 64)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.turns:
        if not args.url:
            p.error("--turns needs --url")
        rows = conversation(args.url, args.turns, args.turn_tokens, args.reply_tokens, args.vocab, args.seed,
                            args.timeout)
        print(f"{'turn':>5} {'tokens':>7} {'ttft ms':>8} {'prompt ms':>9} {'prompt_n':>8} {'cache_n':>8}")
        for r in rows:
            print(f"{r['turn']:>5} {r['tokens']:>7} {r['ttft_ms']:>8.1f} {r['server_prompt_ms']:>9.1f} "
                  f"{r['prompt_n']:>8} {r['cache_n']:>8}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"turns": rows, "url": args.url}, f, indent=1)
        return 0
    if args.url:
        cases = prompts(lengths, args.vocab, args.seed)
        # the client's own first use (urllib, its first connection) before any timed request, timed apart
        started = time.perf_counter()
        urllib.request.urlopen(f"{args.url.rstrip('/')}/health", timeout=args.timeout).read()
        health_ms = 1000 * (time.perf_counter() - started)
        print(f"the client's first request (GET /health): {health_ms:.1f} ms")
        rows = [over_http(args.url, ids, args.timeout) for ids in cases]
        meta = {"url": args.url, "first_health_ms": health_ms}
        for row in rows:
            row.pop("reply")
    else:
        rows, meta = in_process(args.model, args.drafter, args.ctx_size, lengths, args.seed, args.ubatch_size)
        print(f"loaded in {meta['load_s']:.1f} s, warm-up {meta['warm_up_s'] or 0:.1f} s", file=sys.stderr)
    print(f"{'request':>7} {'tokens':>6} {'ttft ms':>8} {'prompt ms':>9}")
    for i, (n, row) in enumerate(zip(lengths, rows), 1):
        prompt = row.get("server_prompt_ms", row.get("prompt_ms"))
        print(f"{i:>7} {n:>6} {row['ttft_ms']:>8.1f} {prompt if prompt is None else f'{prompt:.1f}':>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": lengths, "rows": rows, **meta}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
