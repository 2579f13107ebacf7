"""Batched steps of several streams (issue #23) on the engine's default GPU path: N sequences stepped together
(launch with defer, one flush a round: one drafter pass, one target pass over every sequence's rows, graphed per
composition) against one sequence's pipelined steps.

    PYTHONPATH=src python scripts/gpu/batched_run.py OUT [--shape qwen3-8b] [--streams 1,2,4,8,16] [--tau 6]
    PYTHONPATH=src python scripts/gpu/batched_run.py OUT --demo [--streams ...]

For each N, plain and DFlash (planted oracle at tau, the drafter really running; --demo: the embedded demo pair
on the bench's code prompts, its own drafter's guesses): total tok/s over the timed rounds, per-stream tok/s, and
the ratios the issue asks for (total against one stream's; per-stream DFlash speedup against the single stream's).
First, checks: the fused target pass over segments gives every row the bits of its sequence's pass alone, and
batched greedy tokens equal each sequence's alone. Runs on the CPU too (a tiny shape, eager), to try the script.
Writes OUT/batched.json (--demo: OUT/batched_demo.json) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from flashdraft.bench.oracle import PlantedOracle
from flashdraft.bench.prompts import load_prompt_set
from flashdraft.bench.synthetic import SHAPES, build_synthetic, synchronize
from flashdraft.config import SamplingParams
from flashdraft.demo import demo_paths
from flashdraft.engine.generator import Engine, set_batch
from flashdraft.engine.model_prep import resolve_plan


# plain decoding, DFlash drafting the full block every step, and the server's adaptive policy (at most the block)
MODES = ("plain", "dflash", "adaptive")


def log(*parts) -> None:
    print(*parts, flush=True)


def check_rows(engine: Engine, dev: torch.device) -> bool:
    """Three sequences' rows (16 + 1 + 16) in one target pass against each sequence's pass alone: bitwise."""
    target, taps = engine.decoder.target, engine.decoder.tap_ids
    g = torch.Generator(device="cpu").manual_seed(0)
    vocab = target.config.vocab_size
    alone_caches = [target.new_cache(128) for _ in range(3)]
    batch_caches = [target.new_cache(128) for _ in range(3)]
    tokens, positions, segments, alone = [], [], [], []
    with torch.inference_mode():
        for i, (start, rows) in enumerate([(40, 16), (7, 1), (80, 16)]):
            history = torch.randint(0, vocab, (start,), generator=g).to(dev)
            for cache in (alone_caches[i], batch_caches[i]):  # the same earlier rows in both caches
                target(history, torch.arange(start, device=dev), cache, start, causal=True)
            t = torch.randint(0, vocab, (rows,), generator=g).to(dev)
            p = torch.arange(start, start + rows, device=dev)
            alone.append(target(t, p, alone_caches[i], start + rows, taps))
            tokens.append(t)
            positions.append(p)
            segments.append((rows, batch_caches[i], start + rows))
        logits, tap_out = target.forward_segments(torch.cat(tokens), torch.cat(positions), segments, taps)
    same, at = True, 0
    for (rows, _, _), (ref_logits, ref_taps) in zip(segments, alone):
        same &= torch.equal(logits[at:at + rows], ref_logits) and torch.equal(tap_out[at:at + rows], ref_taps)
        at += rows
    return bool(same)


def stream_policies(engine: Engine, n: int) -> list:
    """A server's slots' draft policies for n streams stepping together: the engine's default (adaptive, priced
    for the pair and device), each told the stream count."""
    policies = [engine.make_policy() for _ in range(n)]
    set_batch(policies, n)
    return policies


def start(dec, seqs, prompts: list[list[int]], oracles, params: SamplingParams) -> None:
    """Each sequence's prompt prefilled again (its caches and graphs kept) and its oracle's pattern from step 0."""
    for seq, p, oracle in zip(seqs, prompts, oracles):
        if oracle is not None:
            oracle.reset()
        dec.prefill(seq, p, params, 0)
    synchronize(dec.device)


def batch_graphs(engine: Engine) -> int:
    """The batched-step graphs the decoder holds (a graph per composition of the steps' lengths and cache reads)."""
    graphs = engine.decoder.graphs
    return sum(1 for key in graphs.graphs if key[0] == "batch") if graphs is not None else 0


def run_streams(engine: Engine, prompts: list[list[int]], draft: int, oracles, rounds: int, warm: int,
                params: SamplingParams, policies: list | None = None) -> tuple[float, float, list[list[int]]]:
    """Step len(prompts) sequences together as a server's rounds do: each round every sequence launches a step
    deferred and one flush runs them all; with graphs the flush queues the batched step and the round before is
    collected after it (pipelined, the host's work beside the device's). First `warm` + `rounds` untimed rounds
    (every graph the timed rounds need is captured then: a graph per cache bucket the sequences reach), then the
    prompts again into the same sequences (the same caches, so the same graphs) and `rounds` timed rounds.
    policies: each sequence's draft policy (the engine's adaptive one, told the stream count and each round the
    batch's length, batch_length), which learns from its result, as a server's slot does; None: `draft` each
    step.
    Returns (committed tokens per second over the timed rounds, the device's ms per batched step (CUDA; else 0),
    each sequence's tokens after its prompt in the timed rounds)."""
    dec = engine.decoder
    seqs = [dec.new_sequence(o) for o in oracles]
    counted, device_s, batches = 0, 0.0, 0

    def collect(launched) -> None:
        nonlocal counted, device_s, batches
        for i, (seq, step) in enumerate(zip(seqs, launched)):
            result = dec.collect(seq, step)
            counted += len(result.committed)
            if policies:
                policies[i].record(result.drafted, result.accepted)
        device_s += result.seconds or 0.0  # the batched step's device time, the same for each of its steps
        batches += 1

    def run(n_rounds: int) -> None:
        pending = None
        for _ in range(n_rounds):
            if policies:  # one length for the round's drafting streams, as the server's scheduler gives them
                set_batch(policies, len(policies))
            launched = [dec.launch(seq, policies[i].next_length(draft) if policies else draft, defer=True)
                        for i, seq in enumerate(seqs)]
            dec.flush()
            if pending is not None:
                collect(pending)
            pending = launched
        collect(pending)

    for timed in (False, True):
        start(dec, seqs, prompts, oracles, params)
        began, counted, device_s, batches = time.perf_counter(), 0, 0.0, 0
        run(rounds if timed else warm + rounds)
    synchronize(dec.device)
    elapsed = time.perf_counter() - began
    return counted / elapsed, 1000 * device_s / batches, [seq.tokens[len(p):] for seq, p in zip(seqs, prompts)]


def measure_modes(engine: Engine, prompts: list[list[int]], make_oracles, args, params: SamplingParams,
                  single_dflash: float, identical) -> dict:
    """One stream count's row (len(prompts) streams): each mode's total and per-stream tok/s, whether every stream's
    tokens are as alone (identical(committed)), the device's ms per batched step, the batched-step graphs held, the
    adaptive policies' lengths; DFlash's and the adaptive policy's speedup per stream over plain decoding and
    total against one stream's (single_dflash). make_oracles(n): the drafting streams' oracles (None: the drafter's
    own guesses)."""
    n, B = len(prompts), engine.decoder.block_size
    row = {"streams": n}
    for name in MODES:
        draft = 0 if name == "plain" else B - 1
        policies = stream_policies(engine, n) if name == "adaptive" else None
        tok_s, device_ms, committed = run_streams(engine, prompts, draft, make_oracles(n) if draft else [None] * n,
                                                  args.rounds, args.warm, params, policies)
        row[name] = {"total_tok_s": tok_s, "per_stream_tok_s": tok_s / n, "identical": identical(committed),
                     "device_ms_per_batch": device_ms, "batch_graphs_held": batch_graphs(engine)}
        if policies:
            row[name]["lengths"] = [p.length for p in policies]
    for name in ("dflash", "adaptive"):
        row[f"{name}_speedup_per_stream"] = row[name]["per_stream_tok_s"] / row["plain"]["per_stream_tok_s"]
        row[f"{name}_total_vs_one_stream"] = row[name]["total_tok_s"] / single_dflash
    return row


def profile_rounds(engine: Engine, prompts, draft: int, oracles, params: SamplingParams, warm: int,
                   rounds: int = 8) -> list[dict]:
    """Device time by kernel over `rounds` timed rounds (after `warm`), per round, under torch.profiler; printed
    and returned (the 20 costliest)."""
    from torch.profiler import ProfilerActivity, profile
    dec = engine.decoder
    seqs = [dec.new_sequence(o) for o in oracles]
    start(dec, seqs, prompts, oracles, params)

    def round_() -> None:
        launched = [dec.launch(seq, draft, defer=True) for seq in seqs]
        dec.flush()
        for seq, step in zip(seqs, launched):
            dec.collect(seq, step)

    for _ in range(warm + rounds):  # every graph the profiled rounds replay is captured
        round_()
    start(dec, seqs, prompts, oracles, params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            round_()
        synchronize(dec.device)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "calls_per_round": e.count / rounds, "us_per_round": us / rounds})
    rows.sort(key=lambda r: -r["us_per_round"])
    total = sum(r["us_per_round"] for r in rows)
    log(f"profile, {len(prompts)} streams, DFlash: device time {total / 1000:.2f} ms a round (kernels)")
    for r in rows[:20]:
        log(f"  {r['us_per_round']:9.1f} us  {r['calls_per_round']:6.1f} calls  {r['kernel']}")
    return rows[:20]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default=None, help="synthetic shape (default qwen3-8b on CUDA, tiny on the CPU)")
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--tau", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each stream (synthetic)")
    ap.add_argument("--demo", action="store_true", help="the embedded demo pair on the code prompts")
    ap.add_argument("--profile", type=int, default=0,
                    help="at this many streams, also profile DFlash rounds: device time by kernel")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    streams = [int(s) for s in args.streams.split(",")]
    if args.demo:
        return run_demo(args, out, dev, streams)
    shape = args.shape or ("qwen3-8b" if dev.type == "cuda" else "tiny")
    B = SHAPES[shape][2]
    tokens = (args.warm + args.rounds) * B + 64
    capacity = args.context + tokens + 64
    plan = resolve_plan(dev, block_size=B, slots=max(streams))
    target, drafter = build_synthetic(shape, dev, dtype, capacity, plan=plan)
    # compile=False: prefill runs eagerly (not timed here), sparing the module path's compile
    engine = Engine(target, None, drafter, context_size=capacity, compile=False)
    dec = engine.decoder
    log(f"{shape} on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}: plan {plan}, batches "
        f"{dec.batches}, graphs {dec.graphs is not None}, block {B}, prompt {args.context}")
    if not dec.batches:
        log("the decoder does not batch steps on this path: nothing to measure")
        return 1
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    vocab = target.config.vocab_size
    # two distinct prompts (stream i takes prompt i % 2), each's reference continuation from one sequence alone
    distinct = [[1 + (7 * i + j) % (vocab - 2) for j in range(args.context)] for i in range(2)]
    prompts = [distinct[i % 2] for i in range(max(streams))]
    t0 = time.perf_counter()
    alone = [p + engine.generate(p, params, 0).tokens for p in distinct]
    references = [alone[i % 2] for i in range(max(streams))]
    log(f"references: {time.perf_counter() - t0:.1f} s")
    accept = min(args.tau - 1, B - 1)

    def oracles(n):
        return [PlantedOracle(r, lambda s: accept, vocab, dev) for r in references[:n]]

    report = {"shape": shape, "device": str(dev), "plan": str(plan), "tau": accept + 1, "rounds": args.rounds,
              "context": args.context, "checks": {}, "rows": []}
    report["checks"]["rows_bitwise"] = check_rows(engine, dev)
    log(f"check: target rows over segments bitwise as alone: {report['checks']['rows_bitwise']}")
    # one sequence's pipelined steps (the engine's single-stream path), plain and DFlash
    singles = {}
    for name, draft in (("plain", 0), ("dflash", B - 1)):
        oracle = oracles(1)[0] if draft else None
        seq = engine.new_sequence(oracle)  # one sequence and oracle: the timed run replays the first run's graphs
        engine.generate(prompts[0], params, draft, sequence=seq)
        if oracle is not None:
            oracle.reset()
        result = engine.generate(prompts[0], params, draft, sequence=seq)
        s = result.stats
        singles[name] = (s.predicted_n - 1) / (s.predicted_ms / 1000)
        same = prompts[0] + result.tokens == references[0][:len(prompts[0]) + len(result.tokens)]
        report["checks"][f"single_{name}_identical"] = same
    log(f"one stream, pipelined: plain {singles['plain']:.1f} tok/s, DFlash {singles['dflash']:.1f} tok/s "
        f"({singles['dflash'] / singles['plain']:.2f}x)")
    report["single"] = singles
    for n in streams:
        row = measure_modes(engine, prompts[:n], oracles, args, params, singles["dflash"],
                            lambda committed: all(r[len(p):len(p) + len(c)] == c
                                                  for r, p, c in zip(references, prompts, committed)))
        report["rows"].append(row)
        (out / "batched.json").write_text(json.dumps(report, indent=1))  # each row as it comes: a call may end early
        log(f"{n:3d} streams: plain {row['plain']['total_tok_s']:8.1f} tok/s total ({row['plain']['per_stream_tok_s']:7.1f}"
            f" each), DFlash {row['dflash']['total_tok_s']:8.1f} total ({row['dflash']['per_stream_tok_s']:7.1f} each, "
            f"{row['dflash_speedup_per_stream']:.2f}x plain per stream; {row['dflash_total_vs_one_stream']:.2f}x one "
            f"pipelined stream's); tokens as alone: plain {row['plain']['identical']}, DFlash {row['dflash']['identical']}; "
            f"device ms per batched step: plain {row['plain']['device_ms_per_batch']:.2f}, DFlash "
            f"{row['dflash']['device_ms_per_batch']:.2f}")
        log(f"     adaptive DFlash (the server's policy for {n} streams, lengths now {row['adaptive']['lengths']}): "
            f"{row['adaptive']['total_tok_s']:8.1f} total ({row['adaptive_speedup_per_stream']:.2f}x plain per stream; "
            f"{row['adaptive_total_vs_one_stream']:.2f}x one pipelined stream's), tokens as alone "
            f"{row['adaptive']['identical']}, device ms per batched step {row['adaptive']['device_ms_per_batch']:.2f}, "
            f"batch graphs held {row['adaptive']['batch_graphs_held']}")
        if dev.type == "cuda":
            log(f"     peak memory {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
        if n == args.profile:
            report["profile"] = profile_rounds(engine, prompts[:n], B - 1, oracles(n), params, args.warm)
    (out / "batched.json").write_text(json.dumps(report, indent=1))
    return 0


def run_demo(args, out: Path, dev: torch.device, streams: list[int]) -> int:
    """The demo pair, its own drafter, the code prompts (stream i takes prompt i % 3): plain and DFlash at each N,
    the tokens of every stream against its prompt's alone (greedy)."""
    engine = Engine.load(*demo_paths(), device=dev, slots=max(streams))
    dec = engine.decoder
    B = dec.block_size
    log(f"demo pair on {dev}: plan {dec.plan}, batches {dec.batches}, graphs {dec.graphs is not None}, block {B}")
    if not dec.batches:
        log("the decoder does not batch steps on this path: nothing to measure")
        return 1
    tokens = (args.warm + args.rounds) * B + 64
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    distinct = [engine.encode_prompt(messages=p.messages) for p in load_prompt_set("code")]
    alone = [engine.generate(p, params, 0).tokens for p in distinct]
    report = {"pair": "demo", "device": str(dev), "plan": str(dec.plan), "rounds": args.rounds, "rows": []}
    singles = {}
    for name, draft in (("plain", 0), ("dflash", B - 1)):
        engine.generate(distinct[0], params, draft)  # captures
        s = engine.generate(distinct[0], params, draft).stats
        singles[name] = (s.predicted_n - 1) / (s.predicted_ms / 1000)
    report["single"] = singles
    log(f"one stream, pipelined: plain {singles['plain']:.1f} tok/s, DFlash {singles['dflash']:.1f} tok/s")
    for n in streams:
        prompts = [distinct[i % len(distinct)] for i in range(n)]
        row = measure_modes(engine, prompts, lambda k: [None] * k, args, params, singles["dflash"],
                            lambda committed: all(alone[i % len(distinct)][:len(c)] == c
                                                  for i, c in enumerate(committed)))
        report["rows"].append(row)
        (out / "batched_demo.json").write_text(json.dumps(report, indent=1))
        log(f"{n:3d} streams: plain {row['plain']['total_tok_s']:8.1f} tok/s total, DFlash "
            f"{row['dflash']['total_tok_s']:8.1f} ({row['dflash_speedup_per_stream']:.2f}x plain per stream, "
            f"{row['dflash_total_vs_one_stream']:.2f}x one stream's), adaptive {row['adaptive']['total_tok_s']:8.1f} "
            f"({row['adaptive_speedup_per_stream']:.2f}x, {row['adaptive_total_vs_one_stream']:.2f}x); tokens as "
            f"alone: plain {row['plain']['identical']}, DFlash {row['dflash']['identical']}, adaptive "
            f"{row['adaptive']['identical']}")
    (out / "batched_demo.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
