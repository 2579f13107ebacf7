"""`flashdraft bench`: the same prompts with plain decoding and with DFlash, side by side.

In process (default) one engine is loaded and each prompt runs both ways with the same sampling and seed;
with --url the prompts go to running servers instead. The table streams to stdout as prompts finish (to
stderr with --json, whose stdout is exactly one JSON object); the progress bar is on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from flashdraft.cli import (add_cache_args, add_hub_refusals, add_sampling_args, cache_args_from_args,
                            given_cache_flags, resolve_model_paths, sampling_from_args, set_threads)

PROG = "flashdraft bench"
# Timed repetitions per prompt and way: enough to see whether they agree (the table's spread), and the
# no-argument run (demo pair, 3 code prompts, 256 tokens) stays under 3 minutes on 2 CPU cores (docs/bench.md).
DEFAULT_REPS = 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=(
        "Benchmark plain decoding against DFlash on the same prompts: tokens/s, speedup, generation time, "
        "tau, acceptance rate, draft lengths and (greedy) whether the outputs are identical. Without -m or "
        "--url it benchmarks the embedded demo pair on the code prompts."))
    p.add_argument("-m", "--model", default=None, help="target model folder (default: the embedded demo model)")
    add_hub_refusals(p)
    p.add_argument("-md", "--spec-draft-model", "--drafter", dest="drafter", default=None,
                   help="DFlash drafter folder (default with no -m: the demo drafter)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size in tokens (in-process)")
    p.add_argument("--device", default=None, help="cpu or cuda (in-process; default: cuda if available)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for torch (in-process; default: torch's)")
    p.add_argument("--spec-type", choices=("dflash", "ngram", "dflash+ngram"), default="dflash",
                   help="what drafts against plain decoding: the DFlash drafter (default), n-gram lookup in the "
                        "text itself (no drafter model), or both (the lookup's proposal where it is long, the "
                        "drafter's elsewhere); in-process")
    p.add_argument("--draft-n", type=int, default=None,
                   help="fixed DFlash draft length (default: the engine's draft policy; with --url: the server's)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="no adaptive draft control: DFlash drafts the full block on every step (in-process)")
    p.add_argument("--prompts", default="code", metavar="code|prose|multiturn|agent|FILE",
                   help="built-in prompt set or a JSONL file of {name, prompt|messages|turns} (default: code)")
    p.add_argument("--context", type=int, default=0, metavar="N",
                   help="precede every prompt with N tokens of Python source: the same prompts at a depth of N "
                        "tokens of context (in-process and --synthetic; default 0)")
    p.add_argument("--concurrency", type=int, default=1, metavar="N",
                   help="with --url: N client streams at once, each way in turn; total and per-stream tok/s "
                        "(default 1: the per-prompt table)")
    p.add_argument("--reps", type=int, default=DEFAULT_REPS,
                   help=f"timed repetitions per prompt and way, after one untimed warm-up (default {DEFAULT_REPS})")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (table goes to stderr)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="write a PNG: tok/s per prompt, tau annotated")
    p.add_argument("--url", default=None, help="benchmark a running server with DFlash (OpenAI-style API)")
    p.add_argument("--baseline-url", default=None, help="a server without drafting for the baseline (default: "
                   "--url with \"speculative.n_max\": 0 per request)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one server response (default 600)")
    p.add_argument("--synthetic", metavar="SHAPE", default=None,
                   help="synthetic benchmark of a model shape (flashdraft.bench.synthetic)")
    add_sampling_args(p)
    add_cache_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.context < 0:  # both modes take it
        print(f"{PROG}: error: --context must be >= 0, got {args.context}", file=sys.stderr)
        return 1
    if args.synthetic is not None:
        cache_flags = given_cache_flags(args)
        if cache_flags:
            print(f"{PROG}: error: --synthetic does not take cache or prefill options yet ({', '.join(cache_flags)})",
                  file=sys.stderr)
            return 1
        # the synthetic shapes have their models, drafter, prompt and oracle-planned draft lengths
        others = [flag for flag, given in (
            ("-m", args.model), ("-md", args.drafter), ("-c", args.ctx_size), ("-t", args.threads),
            ("--spec-type", args.spec_type != "dflash"), ("--draft-n", args.draft_n is not None),
            ("--no-adaptive", args.no_adaptive), ("--prompts", args.prompts != "code"),
            ("--concurrency", args.concurrency != 1), ("--reps", args.reps != DEFAULT_REPS), ("--plot", args.plot),
            ("--url", args.url), ("--baseline-url", args.baseline_url)) if given]
        if others:
            print(f"{PROG}: error: --synthetic does not take {', '.join(others)}", file=sys.stderr)
            return 1
        return run_synthetic(args)

    from flashdraft.bench.prompts import load_prompt_set
    from flashdraft.bench.runner import BenchError
    from flashdraft.config import ConfigError
    try:
        check_args(args)
        prompts = load_prompt_set(args.prompts)
        params = sampling_from_args(args)
        params.validate()
        if params.seed is None:  # one seed for both ways and every repetition, reported so runs can be repeated
            from flashdraft.engine.speculative import resolve_seed
            params.seed = resolve_seed(params)
        backend, config = make_backend(args, params)
        if args.concurrency > 1:
            report = run_concurrently(backend, prompts, args, config)
        else:
            report = run(backend, prompts, args, config, greedy=params.greedy)
        if args.plot:
            from flashdraft.bench.plot import write_plot
            print(f"{PROG}: wrote {write_plot(report, args.plot)}", file=sys.stderr)
    except (BenchError, ConfigError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(report))
    return 0


def check_args(args) -> None:
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.concurrency > 1 and not args.url:
        raise ValueError("--concurrency needs --url: concurrent streams go to a server's slots (flashdraft serve -np N)")
    if args.concurrency > 1 and args.plot:
        raise ValueError("--plot draws the per-prompt table, which --concurrency does not make")
    if args.baseline_url and not args.url:
        raise ValueError("--baseline-url needs --url (the server with DFlash)")
    if args.url:
        local = [flag for flag, value in (("-m", args.model), ("-md", args.drafter), ("-c", args.ctx_size),
                                          ("--device", args.device), ("-t", args.threads),
                                          ("--context", args.context or None)) if value is not None]
        if args.spec_type != "dflash":
            local.append("--spec-type")
        if args.no_adaptive:
            local.append("--no-adaptive")
        local += given_cache_flags(args)
        if local:
            raise ValueError(f"{', '.join(local)} apply to in-process runs; with --url the server has its model "
                             "and its draft policy (flashdraft serve --no-spec-dm-adaptive drafts the full block)")
        if args.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    if args.draft_n is not None and args.draft_n < 1:
        raise ValueError(f"--draft-n must be >= 1 (0 would be the baseline), got {args.draft_n}")
    if args.draft_n is not None and args.no_adaptive:
        raise ValueError("--draft-n and --no-adaptive: a fixed length is not adaptive already; pass one of them")
    if args.plot:
        from pathlib import Path
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir():  # fail before the run, not after it
            raise ValueError(f"--plot: folder {folder} does not exist")


def make_backend(args, params):
    from flashdraft.bench.runner import BenchError, InProcessBackend, ServerBackend
    config = {"prompt_set": args.prompts, "n_predict": params.max_tokens, "temperature": params.temperature,
              "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p, "seed": params.seed,
              "reps": args.reps, "warmup": 1, "context": args.context,
              "draft": args.draft_n if args.draft_n is not None else "full" if args.no_adaptive else "default"}
    if args.url:
        backend = ServerBackend(args.url, args.baseline_url, params, args.draft_n, args.timeout)
        return backend, {"mode": "server", "url": backend.url, "baseline_url": backend.baseline_url, **config}

    from flashdraft.demo import demo_name
    from flashdraft.engine.generator import Engine
    from flashdraft.engine.ngram import NgramSettings
    set_threads(args.threads)
    ngram = args.spec_type in ("ngram", "dflash+ngram")
    if args.spec_type == "ngram" and args.drafter:
        raise ValueError("--spec-type ngram drafts by lookup in the text itself: drop -md")
    model, drafter = resolve_model_paths(args.model, args.drafter, draft=args.spec_type != "ngram")
    print(f"{PROG}: loading {model}" + (f" with drafter {drafter}" if drafter else "")
          + (", n-gram drafting" if ngram else ""), file=sys.stderr)
    cache_types = cache_args_from_args(args, drafter is not None)
    engine = Engine.load(model, drafter, device=args.device, context_size=args.ctx_size,
                         adaptive=not args.no_adaptive, ngram=NgramSettings() if ngram else None,
                         name=demo_name(model), **cache_types)
    if not engine.drafts:
        raise BenchError("bench compares plain decoding with DFlash: pass a drafter with -md DRAFTER_FOLDER")
    if args.draft_n is not None and args.draft_n > engine.max_draft:
        raise ValueError(f"--draft-n must be between 1 and {engine.max_draft} (block size - 1), got {args.draft_n}")
    # as serve warms each slot at load: the prompt passes' and steps' graphs and compiled layers are made before the
    # first prompt, so that its time to first token is what a server's first request gets (None on a CPU)
    warm_up_s = engine.warm_up(sampling=[] if params.greedy else [params])
    if warm_up_s is not None:
        print(f"{PROG}: warmed up in {warm_up_s:.1f} s", file=sys.stderr)
    device = str(engine.decoder.device)
    policy = args.draft_n if args.draft_n is not None else engine.make_policy()
    draft_cost = getattr(policy, "cost", None)
    return InProcessBackend(engine, params, policy, args.context), {
        "mode": "in-process", "spec_type": args.spec_type, "model": engine.name, "model_path": str(model),
        "drafter_path": str(drafter),
        "device": device, "context_size": engine.context_size, "block_size": engine.decoder.block_size,
        "threads": torch_threads(), "cache_types": cache_types, "warm_up_s": warm_up_s, **config,
        **({"draft_cost": {"fixed": draft_cost.fixed, "per_token": draft_cost.per_token}} if draft_cost else {})}


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def run(backend, prompts, args, config: dict, greedy: bool) -> dict:
    from flashdraft.bench.report import build_report, prompt_row, summary_notes, summary_row, table_header, table_row
    from flashdraft.bench.runner import run_bench
    table = sys.stderr if args.json else sys.stdout
    total = 2 + 2 * args.reps * sum(p.cases for p in prompts)
    with tqdm(total=total, desc="bench", unit="gen", file=sys.stderr, disable=None, leave=False) as bar:
        bar.write(table_header(), file=table)
        results = run_bench(backend, prompts, args.reps, on_generation=bar.update,
                            on_result=lambda r: bar.write(table_row(prompt_row(r, greedy)), file=table))
    report = build_report(results, greedy, config)
    print("-" * len(table_header().splitlines()[0]), file=table)
    print(summary_row(report["summary"]), file=table)
    for note in summary_notes(report["summary"]):
        print(note, file=table)
    return report


def run_concurrently(backend, prompts, args, config: dict) -> dict:
    from flashdraft.bench.runner import run_concurrent
    table = sys.stderr if args.json else sys.stdout
    total = 2 + 2 * args.concurrency * args.reps * len(prompts)
    with tqdm(total=total, desc="bench", unit="gen", file=sys.stderr, disable=None, leave=False) as bar:
        result = run_concurrent(backend, prompts, args.concurrency, args.reps, on_generation=bar.update)
    print(f"{'way':10s}{'streams':>8s}{'requests':>10s}{'tokens':>8s}{'wall s':>8s}{'total tok/s':>13s}"
          f"{'per stream':>12s}{'ttft ms':>9s}{'tau':>7s}", file=table)
    for way in ("baseline", "dflash"):
        w = result[way]
        per_stream = "-" if w["per_stream_tok_s"] is None else f"{w['per_stream_tok_s']:.1f}"
        ttft = "-" if w["ttft_ms"] is None else f"{w['ttft_ms']:.0f}"
        tau = "-" if w["tau"] is None else f"{w['tau']:.2f}"
        print(f"{way:10s}{result['streams']:>8d}{w['requests']:>10d}{w['tokens']:>8d}{w['wall_s']:>8.2f}"
              f"{w['total_tok_s']:>13.1f}{per_stream:>12s}{ttft:>9s}{tau:>7s}", file=table)
    if result["speedup"] is not None:
        print(f"DFlash / baseline, total tok/s: {result['speedup']:.2f}x", file=table)
    return {"concurrency": result, "config": {**config, "concurrency": args.concurrency}}


def run_synthetic(args) -> int:
    """The synthetic mode (flashdraft.bench.synthetic), when its module is installed: its main(args) gets the
    parsed flags."""
    import importlib
    try:
        synthetic = importlib.import_module("flashdraft.bench.synthetic")
    except ModuleNotFoundError as e:
        if e.name != "flashdraft.bench.synthetic":
            raise
        print(f"{PROG}: error: synthetic mode is not available", file=sys.stderr)
        return 1
    return int(synthetic.main(args) or 0)
