"""Stage 6, evaluate: tau of the pair with the engine's real decoding loop, speed, losslessness and samples.

Greedy (temperature 0) generation with the full block on the held-out Python prompts (each kind of the
prompts stage reported apart, and all together), on hand-written prompts in a style of their own (--handwritten)
and on the prose prompts; then, on some code prompts, the same generation without drafting, for the speed-up and
to check the outputs are identical. tau is the mean over prompts of committed tokens per step (the z-lab
protocol); tau_pooled is all tokens over all steps. eos_first counts prompts the target answered with an end
token at once (a model that ends files in the middle of a function does so).

    python -m flashdraft.demo.pipeline.evaluate --target T --drafter D --prompts runs/demo/prompts --out runs/demo/eval
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flashdraft.config import ConfigError, SamplingParams
from flashdraft.demo.pipeline.corpus import read_jsonl
from flashdraft.demo.pipeline.prompts import KINDS
from flashdraft.engine.generator import Engine

FENCE = "````"  # code in samples may hold ``` (docstring examples)


def encode(engine: Engine, record: dict) -> list[int]:
    if "messages" in record:
        return engine.encode_prompt(messages=record["messages"])
    return engine.encode_prompt(record["prompt"])


def prompt_text(record: dict) -> str:
    return record["messages"][-1]["content"] if "messages" in record else record["prompt"]


def tau_summary(results: list[dict]) -> dict:
    drafted = [r for r in results if r["steps"] > 0]
    steps = sum(r["steps"] for r in drafted)
    context = [len(r["prompt_ids"]) for r in results]
    return {"prompts": len(drafted),
            "tau": sum(r["tau"] for r in drafted) / len(drafted) if drafted else None,
            "tau_pooled": sum(r["steps"] + r["accepted"] for r in drafted) / steps if steps else None,
            "tokens": sum(r["tokens"] for r in drafted),
            "eos_first": sum(r["eos_first"] for r in results),
            "prompt_tokens": [min(context), max(context)] if context else None}


def run_set(engine: Engine, records: list[dict], params: SamplingParams) -> list[dict]:
    results = []
    for rec in records:
        ids = encode(engine, rec)
        if len(ids) + 1 >= engine.context_size:
            continue  # a prompt that leaves no room to generate says nothing about the drafter
        r = engine.generate(ids, params)
        s = r.stats
        results.append({"kind": rec.get("kind", "chat" if "messages" in rec else "code"),
                        "prompt": prompt_text(rec), "output": r.text,
                        "eos_first": not r.tokens and r.stop_type == "eos",
                        "output_ids": r.tokens, "prompt_ids": ids, "tau": s.tau, "steps": s.steps,
                        "accepted": s.draft_n_accepted, "tokens": s.predicted_n,
                        "decode_ms": s.predicted_ms})
    return results


def speed_and_identity(engine: Engine, drafted: list[dict], params: SamplingParams) -> dict:
    """Prompts already generated with drafting, again with drafting (timed warm: the first pass paid for any
    compilation and graph capture) and without: decode speed-up and identical tokens."""
    plain_ms = draft_ms = 0.0
    plain_tokens = draft_tokens = identical = 0
    for r in drafted:
        again = engine.generate(r["prompt_ids"], params)
        plain = engine.generate(r["prompt_ids"], params, draft=0)
        plain_ms += plain.stats.predicted_ms
        plain_tokens += plain.stats.predicted_n
        draft_ms += again.stats.predicted_ms
        draft_tokens += again.stats.predicted_n
        identical += plain.tokens == r["output_ids"] == again.tokens
    return {"prompts": len(drafted), "identical": identical,
            "plain_tokens_per_s": 1000 * plain_tokens / plain_ms if plain_ms else None,
            "dflash_tokens_per_s": 1000 * draft_tokens / draft_ms if draft_ms else None,
            "speedup": (draft_tokens / draft_ms) / (plain_tokens / plain_ms) if plain_ms and draft_ms else None}


def samples_markdown(sets: dict[str, list[dict]], per_kind: int) -> str:
    lines = []
    for name, results in sets.items():
        for kind in KINDS:
            picked = [r for r in results if r["kind"] == kind][:per_kind]
            for r in picked:
                lines += [f"### {name} / {kind} (tau {r['tau']:.2f}, {r['tokens']} tokens)", "",
                          "Prompt:", "", FENCE, r["prompt"].rstrip("\n"), FENCE, "", "Output (greedy):", "",
                          FENCE, r["output"].rstrip("\n"), FENCE, ""]
    return "\n".join(lines)


def evaluate(target: Path, drafter: Path, prompts: Path, out: Path, device: str | None, max_tokens: int,
             speed_prompts: int, samples_per_kind: int, seen: Path | None = None,
             handwritten: Path | None = None) -> dict:
    """seen: prompts the drafter was trained on; their tau beside the held-out one tells fitting from
    generalizing. handwritten: prompts written for the evaluation, in no project's style."""
    engine = Engine.load(target, drafter, device=device)
    if not engine.has_drafter:
        raise ConfigError(f"{drafter}: no drafter loaded")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    code_records, prose_records = read_jsonl(prompts / "heldout_code.jsonl"), read_jsonl(prompts / "prose.jsonl")
    engine.generate(encode(engine, code_records[0]), SamplingParams(max_tokens=8))  # warm-up (lazy init, caches)
    t0 = time.monotonic()
    code, prose = run_set(engine, code_records, params), run_set(engine, prose_records, params)
    if not code:
        raise ValueError(f"{prompts}: no held-out code prompt fits the context ({engine.context_size} tokens)")
    written = run_set(engine, read_jsonl(handwritten), params) if handwritten else []
    report = {"device": str(engine.decoder.device), "block_size": engine.decoder.block_size, "max_tokens": max_tokens,
              "temperature": 0.0, "context_size": engine.context_size,
              "code": tau_summary(code),
              **{f"code_{kind}": tau_summary([r for r in code if r["kind"] == kind]) for kind in KINDS},
              **({"handwritten": tau_summary(written)} if handwritten else {}),
              "prose": tau_summary(prose),
              "speed": speed_and_identity(engine, code[:speed_prompts], params),
              **({"seen": tau_summary(run_set(engine, read_jsonl(seen), params))} if seen else {}),
              "seconds": round(time.monotonic() - t0, 1)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    per_prompt = [{k: v for k, v in r.items() if k not in ("output_ids", "prompt_ids")}
                  for r in code + written + prose]
    (out / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in per_prompt))
    (out / "samples.md").write_text(samples_markdown({"held-out code": code, "hand-written": written, "prose": prose},
                                                     samples_per_kind))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashdraft.demo.pipeline.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True, help="folder written by the prompts stage")
    p.add_argument("--out", type=Path, required=True, help="output folder: eval.json, generations.jsonl, samples.md")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per generation (default 256)")
    p.add_argument("--speed-prompts", type=int, default=8, help="code prompts also run without drafting (default 8)")
    p.add_argument("--samples", type=int, default=3, help="samples per set and kind in samples.md (default 3)")
    p.add_argument("--handwritten", type=Path, default=None,
                   help="also report tau on these prompts (.jsonl), written in no project's style")
    p.add_argument("--seen", type=Path, default=None,
                   help="also report tau on these prompts (.jsonl), e.g. some the drafter was trained on")
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.speed_prompts < 0 or args.samples < 0:
        p.error("--max-tokens must be >= 1, --speed-prompts and --samples >= 0")
    try:
        report = evaluate(args.target, args.drafter, args.prompts, args.out, args.device, args.max_tokens,
                          args.speed_prompts, args.samples, args.seen, args.handwritten)
    except (ValueError, OSError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
