"""Stage 4, prompts: the prompt files for the drafter's training data and for measuring tau.

- train.jsonl: prompts that the target answers to make the drafter's data;
- heldout_code.jsonl: Python prompts from held-out modules, for tau at temperature 0;
- prose.jsonl: English requests, for the tau reported beside it (the model was trained on code only).
Each is a mix of chat requests ({"messages": [user]}, built from a function's docstring) and raw code prefixes
({"prompt": some lines of a file}), the two formats `flashdraft train-drafter --prompts` reads.

The drafter's prompts come from held-out modules too (--drafter-prompts heldout, the default), from a part of
them disjoint from the tau prompts' modules. Prompted with text it trained on (about 3 epochs), the target
recites it: a drafter trained on recitations learns them by rote and not how the target continues new text
(measured on the H200: in-training tau 3.5-10.9, held-out tau 1.7-2.1; docs/demo-model-card.md). Users prompt
with new text, so the drafter's data must be the target's answers to new text as well.

    python -m flashdraft.demo.pipeline.prompts --corpus runs/demo/corpus --out runs/demo/prompts
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

from flashdraft.demo.pipeline.corpus import read_jsonl, write_jsonl

PROSE_REQUESTS = [
    "Explain how a hash table works.",
    "Write a short poem about the sea.",
    "What are the main causes of inflation?",
    "Describe your ideal weekend in a few sentences.",
    "Give me three tips for learning a new language.",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a polite email declining a meeting invitation.",
    "What is the difference between weather and climate?",
    "Tell me a story about a robot who learns to paint.",
    "How do vaccines train the immune system?",
    "List some good habits for staying healthy.",
]
MIN_PREFIX_CHARS = 40
PREFIXES_PER_FILE = 3
TAU_PARTS = 4  # with held-out drafter prompts, one module in TAU_PARTS gives tau prompts, the others the drafter's


def measures_tau(module: str) -> bool:
    """Whether a held-out module's prompts measure tau (else they may feed the drafter): a stable hash split."""
    return int(hashlib.sha1(module.encode()).hexdigest()[:8], 16) % TAU_PARTS == 0


def chat_prompt(request: str) -> dict:
    return {"kind": "chat", "messages": [{"role": "user", "content": request}]}


def code_prefix(text: str, rng: random.Random, max_chars: int) -> str | None:
    """A few consecutive whole lines of a file, ending at a line break, or None if the file has none that fit."""
    lines = text.splitlines(keepends=True)
    for _ in range(4):
        end = rng.randint(1, len(lines))
        start = max(0, end - rng.randint(4, 24))
        prefix = "".join(lines[start:end])
        while len(prefix) > max_chars and start < end - 1:
            start += 1
            prefix = "".join(lines[start:end])
        if MIN_PREFIX_CHARS <= len(prefix) <= max_chars and prefix.strip():
            return prefix
    return None


def mixed_prompts(functions: list[dict], files: list[dict], count: int, chat_share: float, max_chars: int,
                  rng: random.Random) -> list[dict]:
    """count prompts: chat_share of them requests for distinct functions, the rest prefixes of distinct files.

    Prompts are at most max_chars long, so that they leave room for a response in the target's context."""
    functions = [f for f in functions if len(f["request"]) <= max_chars]
    n_chat = min(len(functions), round(count * chat_share))
    chats = [chat_prompt(f["request"]) for f in rng.sample(functions, n_chat)]
    codes = []
    for _ in range(PREFIXES_PER_FILE):  # a second or third prefix per file only when files run short
        for f in rng.sample(files, len(files)):
            if len(codes) >= count - n_chat:
                break
            prefix = code_prefix(f["text"], rng, max_chars)
            if prefix is not None:
                codes.append({"kind": "code", "prompt": prefix})
    out = chats + codes
    rng.shuffle(out)
    return out


def build_prompts(corpus: Path, out: Path, train_count: int, heldout_count: int, chat_share: float = 0.6,
                  max_chars: int = 600, seed: int = 0, drafter_source: str = "heldout") -> dict:
    """drafter_source "heldout": the drafter's prompts from the held-out modules that do not measure tau;
    "train": from the target's own training split."""
    if drafter_source not in ("heldout", "train"):
        raise ValueError(f"drafter prompts come from 'heldout' or 'train', not {drafter_source!r}")
    rng = random.Random(seed)
    functions, files = read_jsonl(corpus / "functions_heldout.jsonl"), read_jsonl(corpus / "heldout.jsonl")
    if drafter_source == "heldout":
        tau_functions = [f for f in functions if measures_tau(f["module"])]
        tau_files = [f for f in files if measures_tau(f["module"])]
        train = mixed_prompts([f for f in functions if not measures_tau(f["module"])],
                              [f for f in files if not measures_tau(f["module"])], train_count, chat_share,
                              max_chars, rng)
    else:
        tau_functions, tau_files = functions, files
        train = mixed_prompts(read_jsonl(corpus / "functions_train.jsonl"), read_jsonl(corpus / "train.jsonl"),
                              train_count, chat_share, max_chars, rng)
    # Held-out tau is reported per kind, so its set is half chat requests, half raw code.
    held_out = mixed_prompts(tau_functions, tau_files, heldout_count, 0.5, max_chars, rng)
    if not train or not held_out:
        raise ValueError(f"{corpus}: no usable prompts ({len(train)} train, {len(held_out)} held-out)")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout_code.jsonl", held_out)
    write_jsonl(out / "prose.jsonl", [chat_prompt(r) for r in PROSE_REQUESTS])
    kinds = lambda rs: {k: sum(r["kind"] == k for r in rs) for k in ("chat", "code")}  # noqa: E731
    return {"train": kinds(train), "drafter_prompts_from": drafter_source, "heldout_code": kinds(held_out),
            "prose": len(PROSE_REQUESTS)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashdraft.demo.pipeline.prompts", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="folder written by the corpus stage")
    p.add_argument("--out", type=Path, required=True, help="output folder for the prompt files")
    p.add_argument("--train", type=int, default=12000, help="prompts for the drafter's data (default 12000)")
    p.add_argument("--drafter-prompts", choices=["heldout", "train"], default="heldout",
                   help="split the drafter's prompts come from: held-out modules not used for tau (default), or "
                        "the target's training split (which the target recites)")
    p.add_argument("--heldout", type=int, default=48, help="held-out Python prompts for tau (default 48)")
    p.add_argument("--chat-share", type=float, default=0.6, help="share of chat requests among train prompts")
    p.add_argument("--max-chars", type=int, default=600,
                   help="longest prompt in characters (default 600, about 200 tokens)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.train < 1 or args.heldout < 1 or not 0 <= args.chat_share <= 1 or args.max_chars < MIN_PREFIX_CHARS:
        p.error(f"--train and --heldout must be >= 1, --chat-share in [0, 1], --max-chars >= {MIN_PREFIX_CHARS}")
    try:
        stats = build_prompts(args.corpus, args.out, args.train, args.heldout, args.chat_share, args.max_chars,
                              args.seed, args.drafter_prompts)
    except (ValueError, OSError) as e:
        print(f"prompts: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
