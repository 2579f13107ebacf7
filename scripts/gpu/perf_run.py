"""One GPU run for docs/performance.md: correctness of the graphed path, then the synthetic benchmark.

Usage (on the GPU machine, from the repo root):
  PYTHONPATH=src python scripts/gpu/perf_run.py OUT_DIR [--skip-check] [--variants=graphs+compiled,...]
      [--attention-config=attention_run.py's attention.json]
Writes OUT_DIR/perf.json and prints a summary table last.
"""
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from flashdraft.bench.synthetic import run  # noqa: E402
from flashdraft.config import SamplingParams  # noqa: E402
from flashdraft.engine.generator import Engine  # noqa: E402
from flashdraft.bench.oracle import PlantedOracle  # noqa: E402


def check_graphed_path_is_lossless(tmp: Path, gemm: str = "cublas", attention: str = "sdpa") -> dict:
    """Tiny random checkpoint on CUDA in float32: graphed DFlash (all acceptance patterns) == graphed baseline
    == eager baseline, token for token (the graphed engine with the given GEMM and attention backends)."""
    from tiny_models import build_drafter, build_target
    target = build_target(tmp / "t", layers=4, init_std=0.3)
    drafter = build_drafter(tmp / "d", target, block_size=16, init_std=0.3)
    eager = Engine.load(target, drafter, device="cuda", dtype=torch.float32, context_size=512, gemm=gemm,
                        attention=attention)
    eager.decoder.graphs = None
    graphed = Engine.load(target, drafter, device="cuda", dtype=torch.float32, context_size=512, gemm=gemm,
                          attention=attention)
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    checked, mismatches = 0, 0
    for i in range(6):
        prompt = list(range(3 + i, 40 + 5 * i))
        ref = eager.generate(prompt, params, 0).tokens
        outs = [graphed.generate(prompt, params, 0).tokens, graphed.generate(prompt, params, 15).tokens]
        oracle = PlantedOracle(prompt + ref, lambda s: (s * 7) % 17, 384, "cuda")
        # in a sequence of its own, freed with the graphs captured for it (graphs_captured counts the others)
        outs.append(graphed.generate(prompt, params, 15, sequence=graphed.new_sequence(oracle=oracle)).tokens)
        sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=200, ignore_eos=True)
        outs.append(graphed.generate(prompt, sampled, 15).tokens == eager.generate(prompt, sampled, 0).tokens)
        checked += 1
        mismatches += sum(o != ref for o in outs[:3]) + (not outs[3])
    return {"gemm": gemm, "attention": attention, "prompts": checked, "mismatches": mismatches,
            "graphs_captured": len(graphed.decoder.graphs)}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    t0 = time.time()
    if "--skip-check" not in sys.argv:
        results["lossless_check"] = [check_graphed_path_is_lossless(Path("/tmp/flashdraft-perf") / b[0], *b)
                                     for b in (("cublas", "sdpa"), ("triton", "triton"))]
        print("lossless check:", results["lossless_check"], f"({time.time() - t0:.0f} s)", flush=True)
    # --variants a,b,...: the Qwen3-8B variants to time (the last one also times the DFlash table, and is the
    # Llama-3.1-8B shape's only variant)
    chosen = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--variants=")), None)
    # --attention-config=FILE: attention_run.py's JSON; its adopted tiling replaces decode_attention.CONFIG
    attention_json = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--attention-config=")), None)
    if attention_json and json.loads(Path(attention_json).read_text()).get("adopted"):
        from flashdraft.layers import decode_attention
        decode_attention.CONFIG = decode_attention.AttentionConfig(**json.loads(Path(attention_json).read_text())["adopted"])
        results["attention_config"] = decode_attention.CONFIG.name
        print("attention config:", decode_attention.CONFIG.name, flush=True)
    qwen_variants = tuple(chosen.split(",")) if chosen else ("eager", "graphs", "graphs+compiled")
    for shape, variants in (("qwen3-8b", qwen_variants), ("llama-3.1-8b", qwen_variants[-1:])):
        t = time.time()
        report = run(shape, "cuda", tokens=256, variants=variants, log=lambda s: print(s, flush=True))
        results[f"{shape} {variants[-1]}"] = report.to_dict()
        print(f"[{shape}] done in {time.time() - t:.0f} s", flush=True)
        (out / "perf.json").write_text(json.dumps(results, indent=2))
        torch.cuda.empty_cache()
    print("\nshape                          variant                    baseline tok/s  %roofline  verify ms  draft ms  "
          "speedup@tau2/4/6/8/16")
    for shape in [k for k in results if " " in k]:
        r = results[shape]
        for v, row in r["variants"].items():
            print(f"{shape:30s} {v:26s} {row['baseline_tok_s']:14.1f} "
                  f"{100 * row['baseline_tok_s'] / r['baseline_roofline_tok_s']:9.0f}%")
        print(f"{'':30s} {'(last) steps':26s} {'':14s} {'':10s} {r['verify_step_ms']:9.3f} {r['draft_step_ms']:9.3f}  "
              + " ".join(f"{d['speedup']:.2f}" for d in r["dflash"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
