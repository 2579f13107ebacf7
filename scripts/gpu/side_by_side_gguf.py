"""flashdraft's half of the GGUF side by side with llama.cpp (scripts/gpu/side_by_side.sh), and the table.

    PYTHONPATH=src python scripts/gpu/side_by_side_gguf.py measure FILE.gguf OUT.json [--depths 0,8192,32768]
        [--prefill 512,8192] [--taus 4,6,8] [--dflash-prompt 512[,32768]] [--tokens 128] [--reps 1]
        [--drafter Q5_K|bf16] [--device cuda]
    python scripts/gpu/side_by_side_gguf.py table RESULTS_DIR [--md TABLE.md] [--json RESULTS.json]

measure: the GGUF file llama-bench reads, loaded by Engine.load (tokenizer, quant blocks and all) and warmed up as
`flashdraft serve` warms each slot at load (Engine.warm_up: among others the CUDA graphs of prompt passes of up to
512 tokens, which a request never captures), measured as llama-bench measures: plain greedy decode of --tokens
tokens after a prompt of each depth (depth 0: a 16-token prompt), prefill of each --prefill length, each after an
untimed warm-up run of the same prompt (llama-bench warms up too). Each decode test runs in a KV cache sized for it
(its prompt, its tokens and a margin: context_for), as llama-bench sizes each test's context (prompt + generated +
depth): the decode attention's tiling follows the cache's capacity (decode_attention.config_for), so a short test
in the longest test's cache would measure the long caches' tiling. Prompts are random token ids. Then DFlash at each
tau with a random drafter of the target's shape (z-lab's Qwen3-8B drafter layout for Llama/Qwen3 targets, its
Gemma-4-31B drafter for Gemma 4; Q5_K blocks, the walkthrough drafter's type, or bf16) in oracle mode
(bench/oracle.py: the drafter runs, its guesses are replaced by the target's own continuation with a planted miss,
so tau is chosen), after a prompt of each --dflash-prompt length (512; 32768 as well for DFlash at long context),
against plain decoding of the same prompt by the same engine (drafter loaded, drafting nothing): its speed is the
speedup's base, its tokens are planted and must come out. (Not the plain engine's: that one is warmed up, so its
prompt passes of up to 512 tokens replay graphs whose attention masks by position, while this engine's run eagerly
on SDPA's causal kernel; on random weights the two caches' last bits can part the greedy continuations, which once
made tau 1.4 and `TOKENS DIFFER` on the H200.)
Every stage records its exception and the run goes on; the JSON is rewritten after each stage. For the roofline,
the JSON also has the bytes a decode step reads (the file's weights; each plain test's cache, halfway through its
run) and, on a GPU, the copy bandwidth measured first in the same process; the table notes each plain row's share
of the roofline these give (docs/performance.md's rooflines count the same bytes).

table: reads RESULTS_DIR/llama-MODEL.json (llama-bench -o json records, any number of runs concatenated) and
RESULTS_DIR/flashdraft-MODEL.json, prints one markdown table with llama.cpp's and flashdraft's tok/s and their
ratio per model and test, and writes it (--md) with everything merged (--json).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_run's random quantized drafters

from flashdraft.config import DRAFT_WINDOW  # noqa: E402

SHORT_PROMPT = 16  # tokens before "depth 0" decoding (llama-bench's tg128 starts from an empty context)


def context_for(prompt_n: int, tokens: int) -> int:
    """The KV cache rows of a test of prompt_n tokens and `tokens` more, with room for a verify block past them."""
    return prompt_n + tokens + 64


def log(msg: str) -> None:
    print(msg, flush=True)


def ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"negative value in {text!r}")
    return values


def kv_types(text: str) -> tuple[str, str] | None:
    """--cache-types K,V: two KV cache types (kv_formats' names); empty: none given."""
    if not text:
        return None
    from flashdraft.quant.kv_formats import kv_format
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not K,V (two KV cache types, e.g. q5_0,q4_1)")
    try:
        return kv_format(parts[0]).name, kv_format(parts[1]).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --- measure ---

class Record:
    """The JSON being built; stages record their exceptions and the run carries on."""

    def __init__(self, out: Path, **fields):
        self.out = out
        self.data: dict = {**fields, "errors": [], "plain": [], "prefill": [], "dflash_baselines": [], "dflash": []}

    def error(self, stage: str, e: BaseException) -> None:
        self.data["errors"].append({"stage": stage, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc(limit=8)[-3000:]})
        log(f"!! {stage}: {type(e).__name__}: {e}")

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.data, indent=1, default=str))


def decode_tok_s(result) -> float:
    """Decode-phase tokens per second (the first token comes out of the prefill)."""
    s = result.stats
    return (s.predicted_n - 1) / (s.predicted_ms / 1000) if s.predicted_ms > 0 else 0.0


def weights_read_gb(path: Path) -> float:
    """GB of the file's tensors a decode step reads: all of them but the token embedding where the file has its own
    LM head (output.weight; then a step reads one embedding row), as stored (quantized blocks at their size)."""
    from flashdraft.loading.gguf import GGUFFile

    tensors = GGUFFile(path, "model").tensors
    skip = {"token_embd.weight"} if "output.weight" in tensors else set()
    return sum(int(t.n_bytes) for name, t in tensors.items() if name not in skip) / 1e9


def kv_read_gb(cache, kv_len: int) -> float:
    """GB of keys and values a decode step reads from `cache` with kv_len positions: every layer's first kv_len rows,
    at most the rows it holds (a sliding layer's ring), at their stored size (packed block rows for block types)."""
    total = 0
    for part in (*cache.k, *cache.v):  # [kv heads, rows, a row's elements]
        total += min(kv_len, part.shape[1]) * part.shape[0] * part.shape[2] * part.element_size()
    return total / 1e9


def prompt_of(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def timed_generate(engine, prompt: list[int], tokens: int, reps: int, draft: int = 0, sequence=None):
    """An untimed warm-up run of the same length (graph captures and compiles for every attention length and verify
    length the timed runs meet: a shorter one left DFlash's captures inside the first timed runs), then the median
    (by decode speed) of reps timed runs (in `sequence`: None for the engine's own)."""
    from flashdraft.config import SamplingParams

    engine.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), draft, sequence)
    runs = [engine.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), draft, sequence)
            for _ in range(reps)]
    return sorted(runs, key=decode_tok_s)[len(runs) // 2]


def build_drafter(target, capacity: int, qtype: str, tiny: bool, dev, dtype, gen):
    """A random DFlash drafter for the target: Gemma 4 targets get z-lab's Gemma-4-31B drafter layout (gguf_run's),
    others a Qwen3-style drafter of the target's own shape (z-lab's rule; bench/synthetic.py's), 5 layers, block 16
    (tiny: 2 layers, block 8), built with the target's LayerPlan (the engine refuses a pair built with two).
    qtype: the projections' GGUF block type, or "bf16"."""
    import gguf_run

    from flashdraft.config import DrafterConfig, ModelConfig, default_tap_ids
    from flashdraft.models.gemma4.config import GEMMA4_MODEL_TYPES, Gemma4DrafterConfig
    from flashdraft.models import DFlashDrafter
    from flashdraft.models.gemma4.drafter import Gemma4DFlashDrafter

    cfg = target.config
    if cfg.model_type in GEMMA4_MODEL_TYPES:
        dcfg = Gemma4DrafterConfig.from_dict(gguf_run.DRAFTER_TINY if tiny else gguf_run.DRAFTER_31B, "drafter")
        with torch.device("meta"):
            drafter = Gemma4DFlashDrafter(dcfg, capacity, float(target.embed_scale), target.plan)
    else:
        layers, block = (2, 8) if tiny else (5, 16)
        raw = {k: getattr(cfg, k) for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                            "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                            "rms_norm_eps", "max_position_embeddings")}
        dcfg = DrafterConfig(layers=ModelConfig.from_dict({**raw, "num_hidden_layers": layers}), block_size=block,
                             mask_token_id=cfg.vocab_size - 1,
                             target_layer_ids=default_tap_ids(cfg.num_hidden_layers, layers),
                             num_target_layers=cfg.num_hidden_layers)
        with torch.device("meta"):
            drafter = DFlashDrafter(dcfg, capacity, target.plan)
    if qtype != "bf16":
        gguf_run.quantize_linears(drafter, lambda name: qtype, dev, dtype, gen)
    gguf_run.materialize(drafter, dev, dtype, gen, {"norm.weight": 1.0})
    drafter.rope = drafter.rope.__class__(dcfg.layers, capacity).to(dev)
    return drafter.eval().requires_grad_(False)


def cache_types(args) -> dict:
    """The engines' KV cache types from --cache-types K,V (the drafter's cache keeps the compute dtype)."""
    if args.cache_types is None:
        return {}
    return {"cache_type_k": args.cache_types[0], "cache_type_v": args.cache_types[1]}


def measure(args) -> int:
    from flashdraft.engine.generator import Engine

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rec = Record(args.out, file=str(args.file), model=args.file.stem, tokens=args.tokens, reps=args.reps,
                 device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
                 date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), build_running=args.build_running,
                 depths=args.depths, prefill_lengths=args.prefill, taus=args.taus, draft_window=args.draft_window)
    longest = max([*args.depths, *args.prefill, *args.dflash_prompt, SHORT_PROMPT])
    context = context_for(longest, args.tokens)
    try:  # the roofline's two numbers: bytes a step reads (the weights here, the cache per test) and the bandwidth
        rec.data["weights_read_gb"] = weights_read_gb(args.file)
        if dev.type == "cuda":
            from flashdraft.bench.synthetic import measure_bandwidth  # the synthetic bench's, as its rooflines
            rec.data["copy_gb_s"] = measure_bandwidth(dev)
            torch.cuda.empty_cache()  # its buffers go, and the peak recorded at the end is the engine's
            torch.cuda.reset_peak_memory_stats(dev)
            log(f"[{args.file.name}] copy bandwidth {rec.data['copy_gb_s']:.0f} GB/s; "
                f"weights read a step {rec.data['weights_read_gb']:.2f} GB")
    except Exception as e:  # noqa: BLE001
        rec.error("roofline", e)
    t = time.time()
    try:
        engine = Engine.load(args.file, device=dev, context_size=context, **cache_types(args))
    except Exception as e:  # noqa: BLE001
        rec.error("load", e)
        rec.save()
        return 1
    target = engine.decoder.target
    vocab = target.config.vocab_size
    rec.data.update(load_s=round(time.time() - t, 1), context=engine.context_size, vocab=vocab,
                    model_type=target.config.model_type)
    if dev.type == "cuda":
        rec.data["weights_gb"] = torch.cuda.memory_allocated(dev) / 1e9
    log(f"[{args.file.name}] loaded in {rec.data['load_s']} s, context {engine.context_size}")
    rec.save()
    sequence = engine.new_sequence()  # the server's slot: warmed up, then every plain run in it
    cache = sequence.target_cache
    rec.data["cache_types"] = f"{cache.k_format.name},{cache.v_format.name}"  # as the engine made them
    try:
        warm = engine.warm_up(sequence)
        rec.data["warm_up_s"] = round(warm, 1) if warm is not None else None
        log(f"  warm-up: {rec.data['warm_up_s']} s")
    except Exception as e:  # noqa: BLE001
        rec.error("warm-up", e)
    rec.save()

    plain_runs = {}
    for depth in sorted(set(args.depths)):
        n = depth or SHORT_PROMPT
        runner, slot = engine, sequence
        try:
            if context_for(n, args.tokens) < engine.context_size:  # a cache of this test's size, warmed up alike
                runner = Engine(engine.decoder.target, engine.tokenizer, None,
                                context_size=context_for(n, args.tokens), **cache_types(args))
                slot = runner.new_sequence()
                runner.warm_up(slot)
            out = timed_generate(runner, prompt_of(n, vocab, seed=n), args.tokens, args.reps, sequence=slot)
            plain_runs[depth] = out
            row = {"depth": depth, "prompt_n": out.stats.prompt_n, "tokens": len(out.tokens),
                   "tok_s": decode_tok_s(out), "prefill_tok_s": out.stats.prompt_n / (out.stats.prompt_ms / 1000),
                   "context": runner.context_size,
                   # the cache a step reads halfway through the run (its mean over the run's steps)
                   "kv_read_gb": kv_read_gb(slot.target_cache, n + len(out.tokens) // 2)}
            rec.data["plain"].append(row)
            log(f"  plain at depth {depth} (a {runner.context_size}-row cache): {row['tok_s']:.1f} tok/s "
                f"(prefill of {n}: {row['prefill_tok_s']:.0f} tok/s)")
        except Exception as e:  # noqa: BLE001
            rec.error(f"plain depth {depth}", e)
        del runner, slot
        rec.save()
    for n in args.prefill:
        try:
            known = plain_runs.get(n)
            out = known if known is not None else timed_generate(engine, prompt_of(n, vocab, seed=n), 1, args.reps,
                                                                 sequence=sequence)
            rec.data["prefill"].append({"prompt_n": n, "tok_s": out.stats.prompt_n / (out.stats.prompt_ms / 1000)})
            log(f"  prefill {n}: {rec.data['prefill'][-1]['tok_s']:.0f} tok/s")
        except Exception as e:  # noqa: BLE001
            rec.error(f"prefill {n}", e)
        rec.save()

    if args.taus:
        tokenizer = engine.tokenizer
        del engine, sequence, plain_runs  # the plain engine's caches go before the drafting engine allocates its own
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        try:
            dflash(target, tokenizer, rec, args, dev, context)
        except Exception as e:  # noqa: BLE001
            rec.error("dflash", e)
    if dev.type == "cuda":
        rec.data["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
    rec.save()
    return 0 if not rec.data["errors"] else 1


def dflash(target, tokenizer, rec: Record, args, dev, context: int) -> None:
    """Plain decoding and DFlash at each tau after each --dflash-prompt length, in an engine whose cache is sized for
    that length (context_for, as the plain tests'); a sequence (its caches, its oracle) per run of the baseline and
    per prompt length of DFlash, each freed before the next."""
    from flashdraft.engine.generator import Engine
    from flashdraft.bench.oracle import PlantedOracle

    ref = target.model.norm.weight
    gen = torch.Generator(device=dev).manual_seed(0)
    t = time.time()
    drafter = build_drafter(target, context + 64, args.drafter, args.tiny, dev, ref.dtype, gen)
    rec.data["drafter"] = {"weights": args.drafter, "block_size": drafter.block_size,
                           "layers": drafter.config.layers.num_hidden_layers, "build_s": round(time.time() - t, 1)}
    B = drafter.block_size
    for n in sorted(set(args.dflash_prompt)):
        spec = Engine(target, tokenizer, drafter, context_size=context_for(n, args.tokens),
                      draft_window=args.draft_window, **cache_types(args))
        prompt = prompt_of(n, target.config.vocab_size, seed=n)
        try:
            base = timed_generate(spec, prompt, args.tokens, args.reps, draft=0, sequence=spec.new_sequence())
        except Exception as e:  # noqa: BLE001
            rec.error(f"dflash {n} plain baseline", e)
            continue
        base_tok_s = decode_tok_s(base)
        rec.data["dflash_baselines"].append({"prompt_n": n, "tok_s": base_tok_s, "context": spec.context_size})
        log(f"  plain after {n} tokens, drafter loaded: {base_tok_s:.1f} tok/s")
        oracle = PlantedOracle(prompt + base.tokens, lambda s: B - 1, target.config.vocab_size, dev)
        planted = spec.new_sequence(oracle=oracle)
        for tau in args.taus:
            accept = min(tau - 1, B - 1)
            try:
                oracle.replan(lambda s, k=accept: k)  # one oracle: graphs captured with it replay the new pattern
                out = timed_generate(spec, prompt, args.tokens, args.reps, draft=B - 1, sequence=planted)
                row = {"prompt_n": n, "tau_planned": accept + 1, "tau": out.stats.tau, "tok_s": decode_tok_s(out),
                       "speedup": decode_tok_s(out) / base_tok_s, "identical": out.tokens == base.tokens}
                rec.data["dflash"].append(row)
                log(f"  DFlash after {n} tokens, tau {row['tau']:.2f}: {row['tok_s']:.1f} tok/s, "
                    f"{row['speedup']:.2f}x plain; same tokens as plain: {row['identical']}")
            except Exception as e:  # noqa: BLE001
                rec.error(f"dflash {n} tau {tau}", e)
            rec.save()
        del planted, oracle, spec
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# --- table ---

def llama_records(path: Path) -> list[dict]:
    """llama-bench -o json output: one JSON array per run, several runs possibly concatenated in one file."""
    text, records, pos = path.read_text(), [], 0
    decoder = json.JSONDecoder()
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return records
        value, pos = decoder.raw_decode(text, pos)
        records += value if isinstance(value, list) else [value]


def llama_ts(records: list[dict], n_prompt: int, n_gen: int, depth: int) -> float | None:
    rows = [r for r in records if r.get("n_prompt") == n_prompt and r.get("n_gen") == n_gen
            and r.get("n_depth", 0) == depth]
    return statistics.median(r["avg_ts"] for r in rows) if rows else None


def roofline_note(ours: dict, depth: int) -> str:
    """flashdraft's plain decoding at this depth against its roofline: the bytes a step reads (weights and cache)
    over the copy bandwidth measured in the same run; empty where the run has not the three figures."""
    row = next((p for p in ours.get("plain", []) if p["depth"] == depth), None)
    if row is None or not ours.get("copy_gb_s") or "weights_read_gb" not in ours or "kv_read_gb" not in row:
        return ""
    weights, kv, bandwidth = ours["weights_read_gb"], row["kv_read_gb"], ours["copy_gb_s"]
    roofline = bandwidth / (weights + kv)
    return (f"{100 * row['tok_s'] / roofline:.0f}% of the roofline ({roofline:.1f} tok/s: {weights:.2f} GB weights "
            f"+ {kv:.2f} GB cache a token at {bandwidth:.0f} GB/s)")


def table_rows(llama: list[dict], ours: dict) -> list[dict]:
    """One row per test: llama.cpp's and flashdraft's tok/s (None where a side has no figure) and a note."""
    gen = next((r["n_gen"] for r in llama if r.get("n_gen")), ours.get("tokens", 128))
    depths = sorted({r.get("n_depth", 0) for r in llama if r.get("n_gen")} | set(ours.get("depths", [])))
    plain = {p["depth"]: p["tok_s"] for p in ours.get("plain", [])}
    rows = [{"test": f"tg{gen}" + (f" @ d{d}" if d else ""), "llama": llama_ts(llama, 0, gen, d),
             "ours": plain.get(d), "note": roofline_note(ours, d)} for d in depths]
    prefill = {p["prompt_n"]: p["tok_s"] for p in ours.get("prefill", [])}
    lengths = sorted({r["n_prompt"] for r in llama if r.get("n_prompt") and not r.get("n_gen")} | set(prefill))
    rows += [{"test": f"pp{n}", "llama": llama_ts(llama, n, 0, 0), "ours": prefill.get(n), "note": ""}
             for n in lengths]
    short = min((d.get("prompt_n", 0) for d in ours.get("dflash", [])), default=0)
    for d in ours.get("dflash", []):
        # against llama.cpp's plain decoding at the depth of the prompt: tg128 for the short one (as before), tg128
        # @ d32768 for a 32K prompt where llama-bench measured that depth
        n = d.get("prompt_n", short)
        depth = n if n != short and llama_ts(llama, 0, gen, n) is not None else 0
        note = f"tau {d['tau']:.2f}, {d['speedup']:.2f}x own plain" + ("" if d["identical"] else ", TOKENS DIFFER")
        if ours.get("draft_window"):
            note += f", drafter window {ours['draft_window']}"
        rows.append({"test": f"DFlash tau {d['tau_planned']} vs tg{gen}" + (f" @ d{depth}" if depth else ""),
                     "llama": llama_ts(llama, 0, gen, depth), "ours": d["tok_s"],
                     "note": (f"after {n} tokens, " if n != short else "") + note})
    return rows


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(args) -> int:
    results = args.results
    models = sorted({p.stem.split("-", 1)[1] for p in results.glob("llama-*.json")}
                    | {p.stem.split("-", 1)[1] for p in results.glob("flashdraft-*.json")})
    if not models:
        print(f"no llama-*.json or flashdraft-*.json in {results}", file=sys.stderr)
        return 1
    lines = ["| model | test | llama.cpp tok/s | flashdraft tok/s | ratio | note |", "|---|---|---|---|---|---|"]
    merged: dict = {}
    for model in models:
        lp, fp = results / f"llama-{model}.json", results / f"flashdraft-{model}.json"
        llama = llama_records(lp) if lp.is_file() else []
        ours = json.loads(fp.read_text()) if fp.is_file() else {}
        rows = table_rows(llama, ours)
        merged[model] = {"llama": llama, "flashdraft": ours, "rows": rows}
        if ours.get("errors"):
            rows.append({"test": "flashdraft errors", "llama": None, "ours": None,
                         "note": "; ".join(e["stage"] + ": " + e["error"][:80] for e in ours["errors"])})
        for r in rows:
            ratio = r["ours"] / r["llama"] if r["ours"] is not None and r["llama"] else None
            lines.append(f"| {model} | {r['test']} | {fmt(r['llama'])} | {fmt(r['ours'])} | "
                         f"{fmt(ratio, 2) + 'x' if ratio is not None else '-'} | {r['note']} |")
    gpus = sorted({r.get("gpu_info", "") for m in merged.values() for r in m["llama"]} - {""})
    devices = sorted({m["flashdraft"].get("device", "") for m in merged.values()} - {""})
    lines.append("")
    lines.append(f"llama.cpp on {', '.join(gpus) or '?'}; flashdraft on {', '.join(devices) or '?'}. "
                 "ratio = flashdraft / llama.cpp.")
    if any(m["flashdraft"].get("build_running") for m in merged.values()):
        lines.append("flashdraft was measured while llama.cpp was being built on the same machine's CPUs.")
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(merged, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="flashdraft on one GGUF file")
    m.add_argument("file", type=Path)
    m.add_argument("out", type=Path)
    m.add_argument("--depths", type=ints, default=[0, 8192, 32768], help="contexts before plain decoding")
    m.add_argument("--prefill", type=ints, default=[512, 8192], help="prompt lengths whose prefill is timed")
    m.add_argument("--taus", type=ints, default=[4, 6, 8], help="DFlash oracle acceptance lengths ('' for none)")
    m.add_argument("--tokens", type=int, default=128, help="generated tokens per run (llama-bench -n)")
    m.add_argument("--dflash-prompt", type=ints, default=[512],
                   help="prompt tokens before DFlash decoding (a list: DFlash after each)")
    m.add_argument("--reps", type=int, default=1, help="timed runs per test (the median is kept)")
    m.add_argument("--drafter", default="Q5_K", choices=["Q5_K", "Q8_0", "Q4_K", "Q6_K", "bf16"],
                   help="the random drafter's weights: GGUF blocks of this type, or bf16")
    m.add_argument("--draft-window", type=int, default=DRAFT_WINDOW, metavar="N",
                   help=f"DFlash's drafter sees only the last N tokens (--spec-dflash-cross-ctx; default "
                        f"{DRAFT_WINDOW}, as flashdraft serve; 0: all of them)")
    m.add_argument("--cache-types", type=kv_types, default=None, metavar="K,V",
                   help="the target's KV cache types, e.g. q5_0,q4_1 (default: the compute dtype)")
    m.add_argument("--device", default=None)
    m.add_argument("--tiny", action="store_true", help="tiny drafters, for make_gguf.py's tiny shapes (tests)")
    m.add_argument("--build-running", action="store_true", help="noted in the JSON: a build shared the CPUs")
    t = sub.add_parser("table", help="the side-by-side table from a results folder")
    t.add_argument("results", type=Path)
    t.add_argument("--md", type=Path, default=None)
    t.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.command == "measure":
        if args.tokens < 2 or args.reps < 1 or not args.dflash_prompt or min(args.dflash_prompt) < 1:
            ap.error("--tokens must be at least 2, --reps and --dflash-prompt at least 1")
        if any(t < 2 for t in args.taus):
            ap.error("--taus must be at least 2 (tau 1 is plain decoding)")
        if args.draft_window < 0:
            ap.error(f"--draft-window must be at least 0 (0: all of the context), got {args.draft_window}")
        args.draft_window = args.draft_window or None
        if not args.file.is_file():
            ap.error(f"no such GGUF file: {args.file}")
        return measure(args)
    return table(args)


if __name__ == "__main__":
    sys.exit(main())
