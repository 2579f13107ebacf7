"""Stage 7, package: the shipped folders (bf16 target and drafter, nothing else) and the run's report.md.

Copies the target's model and tokenizer files and the drafter's config.json + model.safetensors into
OUT/target and OUT/drafter (what goes to src/flashdraft/demo/). If the drafter run was stopped at its time
cap before it saved, the drafter is exported from its last checkpoint. report.md gathers the numbers the model
card asks for from the stages' outputs.

    python -m flashdraft.demo.pipeline.package --run runs/demo --out runs/demo/pair
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from flashdraft.demo.pipeline.prompts import KINDS

SHIPPED_TARGET_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json")
SHIPPED_DRAFTER_FILES = ("config.json", "model.safetensors")
SIZE_LIMIT_MB = 45


def export_from_checkpoint(train_dir: Path) -> None:
    """Write config.json + model.safetensors from the trainer's checkpoint.pt (a run stopped at its cap)."""
    from flashdraft.config import DrafterConfig
    from flashdraft.models import DFlashDrafter
    from flashdraft.train.drafter_setup import save_drafter

    ckpt = train_dir / "checkpoint.pt"
    if not ckpt.is_file():
        raise ValueError(f"{train_dir} has neither a saved drafter (config.json) nor a checkpoint.pt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    drafter = DFlashDrafter(DrafterConfig.from_dict(state["drafter_config"], str(ckpt)), max_positions=1)
    drafter.load_state_dict(state["model"])
    save_drafter(drafter, train_dir, torch.bfloat16)
    print(f"package: exported the drafter from {ckpt} (step {state['step']})")


def copy_files(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    missing = [n for n in names if not (src / n).is_file()]
    if missing:
        raise ValueError(f"{src} lacks {missing}")
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copy(src / n, dst / n)


def folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 2**20


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def last_line(path: Path, key: str) -> dict | None:
    """The last JSON log line that has key."""
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    hits = [r for r in lines if key in r]
    return hits[-1] if hits else None


def fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def report_markdown(run: Path, out: Path, sizes: dict) -> str:
    corpus = read_json(run / "corpus" / "stats.json") or {}
    tokens = read_json(run / "tokenizer" / "tokens" / "meta.json") or {}
    target = last_line(run / "logs" / "target.jsonl", "final_heldout_loss") or {}
    drafter = read_json(run / "drafter_train" / "train_report.json") or {}
    drafter_log = last_line(run / "drafter_train" / "train_log.jsonl", "loss") or {}
    ev = read_json(run / "eval" / "eval.json") or {}
    timings = (run / "logs" / "timings.tsv").read_text() if (run / "logs" / "timings.tsv").is_file() else ""
    target_params = sum(t.numel() for t in _tensors(out / "target"))
    drafter_params = sum(t.numel() for t in _tensors(out / "drafter"))
    speed = ev.get("speed") or {}
    lines = [
        "# Demo pair: numbers from this run", "",
        "| item | value |", "|---|---|",
        f"| corpus | {corpus.get('train_files')} train files ({fmt(corpus.get('train_bytes', 0) / 1e6, 1)} MB), "
        f"{corpus.get('heldout_files')} held-out files ({fmt(corpus.get('heldout_bytes', 0) / 1e6, 1)} MB), "
        f"{corpus.get('train_functions')} chat samples |",
        f"| tokens | {tokens.get('train_tokens')} train, {tokens.get('heldout_tokens')} held-out; vocab "
        f"{tokens.get('vocab_size')}; {tokens.get('bytes_per_token')} bytes/token |",
        f"| target | {target_params / 1e6:.2f} M params, {sizes['target']:.1f} MB bf16; {target.get('steps')} steps, "
        f"{target.get('tokens_seen')} tokens, {target.get('train_seconds')} s |",
        f"| target loss | train {target.get('final_train_loss')}, held-out {target.get('final_heldout_loss')} |",
        f"| drafter | {drafter_params / 1e6:.2f} M params, {sizes['drafter']:.1f} MB bf16; "
        f"{drafter.get('steps', drafter_log.get('step'))} steps, {drafter.get('sequences')} sequences ({drafter.get('response_tokens')} response tokens), "
        f"{drafter.get('train_seconds')} s training; responses to {drafter.get('responses')} of "
        f"{drafter.get('training_prompts')} prompts in {drafter.get('generation_seconds')} s |",
        f"| drafter loss | last window {fmt(drafter_log.get('loss'), 3)}, in-training tau "
        f"{fmt(drafter_log.get('train_tau'))}, slot-1 accuracy {fmt((drafter_log.get('slot_acc') or [None])[0], 3)} |",
        f"| tau, held-out code (block {ev.get('block_size')}, T=0, {ev.get('max_tokens')} tokens) | "
        f"{fmt((ev.get('code') or {}).get('tau'))} ("
        + ", ".join(f"{kind} {fmt((ev.get(f'code_{kind}') or {}).get('tau'))}" for kind in KINDS) + ") |",
        f"| tau, held-out long prompts | {fmt((ev.get('code_long') or {}).get('tau'))} at "
        f"{(ev.get('code_long') or {}).get('prompt_tokens')} tokens of context |",
        f"| tau, hand-written prompts | {fmt((ev.get('handwritten') or {}).get('tau'))} |",
        "| prompts answered with an end token at once | "
        + ", ".join(f"{name} {(ev.get(name) or {}).get('eos_first')}" for name in ("code", "handwritten", "prose"))
        + " |",
        f"| tau, prose | {fmt((ev.get('prose') or {}).get('tau'))} |",
        f"| speed on {ev.get('device')} | plain {fmt(speed.get('plain_tokens_per_s'), 1)} tok/s, DFlash "
        f"{fmt(speed.get('dflash_tokens_per_s'), 1)} tok/s ({fmt(speed.get('speedup'))}x); identical output "
        f"{speed.get('identical')}/{speed.get('prompts')} |",
        f"| size on disk | {sizes['target'] + sizes['drafter']:.1f} MB together (limit {SIZE_LIMIT_MB} MB) |",
        "", "## Stage timings (seconds)", "", "```", timings.rstrip(), "```", "",
    ]
    samples = run / "eval" / "samples.md"
    if samples.is_file():
        lines += ["## Samples", "", samples.read_text()]
    return "\n".join(lines)


def _tensors(folder: Path):
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors")).values()


def package(run: Path, out: Path) -> dict:
    train_dir = run / "drafter_train"
    if not (train_dir / "config.json").is_file():
        export_from_checkpoint(train_dir)
    copy_files(run / "target", out / "target", SHIPPED_TARGET_FILES)
    copy_files(train_dir, out / "drafter", SHIPPED_DRAFTER_FILES)
    sizes = {"target": folder_mb(out / "target"), "drafter": folder_mb(out / "drafter")}
    (out / "report.md").write_text(report_markdown(run, out, sizes))
    if sizes["target"] + sizes["drafter"] > SIZE_LIMIT_MB:
        raise ValueError(f"the pair takes {sizes['target'] + sizes['drafter']:.1f} MB, over the {SIZE_LIMIT_MB} MB "
                         f"limit (shrink --hidden/--layers)")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashdraft.demo.pipeline.package", description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True,
                   help="run folder holding corpus/, tokenizer/, target/, drafter_train/, eval/, logs/")
    p.add_argument("--out", type=Path, required=True, help="output: target/, drafter/, report.md")
    args = p.parse_args(argv)
    try:
        sizes = package(args.run, args.out)
    except (ValueError, OSError) as e:
        print(f"package: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({k: round(v, 2) for k, v in sizes.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
