"""Stage 4, prompts: the prompt files for the drafter's training data and for measuring tau.

- train.jsonl: prompts that the target answers to make the drafter's data;
- heldout_code.jsonl: Python prompts from held-out projects, for tau at temperature 0;
- prose.jsonl: English requests, for the tau reported beside it (the model was trained on code only).
Prompts are of four kinds, in the two formats `flashdraft train-drafter --prompts` reads: chat requests
({"messages": [user]}, built from a function's docstring), and raw text ({"prompt": ...}): `code` (a few lines
of a file), `signature` (a function's first line, or its first lines up to a line break inside the body, the way
people start a function and ask for the rest) and `long` (the start of a file, --long-tokens long: users paste
whole files, and the drafter must keep up deep into the context).

The drafter's prompts come from held-out projects too (--drafter-prompts heldout, the default), from projects
disjoint from the tau prompts' projects. Prompted with text it trained on (about 3 epochs), the target recites
it: a drafter trained on recitations learns them by rote and not how the target continues new text (measured on
the H200: in-training tau 3.5-10.9, held-out tau 1.7-2.1; docs/demo-model-card.md). Users prompt with new text,
so the drafter's data must be the target's answers to new text as well.

    python -m flashdraft.demo.pipeline.prompts --corpus runs/demo/corpus --tokenizer runs/demo/tokenizer \\
        --out runs/demo/prompts
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer

from flashdraft.demo.pipeline.corpus import project_hash, read_jsonl, write_jsonl

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
KINDS = ("chat", "code", "signature", "long")
TRAIN_MIX = {"chat": 0.4, "code": 0.2, "signature": 0.2, "long": 0.2}
HELD_OUT_MIX = {kind: 0.25 for kind in KINDS}  # tau is reported per kind
MIN_PREFIX_CHARS = 40
PREFIXES_PER_FILE = 3
TAU_PARTS = 4  # with held-out drafter prompts, one held-out project in TAU_PARTS gives tau prompts


def tau_projects(projects: set[str]) -> set[str]:
    """The held-out projects whose prompts measure tau (the others may feed the drafter): every TAU_PARTS-th in
    a stable hash order, starting with the first, so there is one whenever there is a project at all."""
    ordered = sorted(projects, key=lambda p: (project_hash(p), p))
    return set(ordered[::TAU_PARTS])


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


def signature_prefix(code: str, rng: random.Random) -> str | None:
    """A function's `def` line alone (no line break, as in `def fibonacci(n):`), or its lines up to a line break
    inside the body (the signature, maybe the docstring and a first statement)."""
    lines = code.splitlines(keepends=True)
    first = next((i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "async def "))), None)
    if first is None:
        return None
    end = first
    while end < len(lines) and not lines[end].rstrip().endswith(":"):
        end += 1
    if end >= len(lines) - 1:
        return None
    if rng.random() < 0.5:
        return "".join(lines[first:end + 1]).rstrip("\n")
    return "".join(lines[first:rng.randint(end + 1, min(len(lines) - 1, end + 6))])


class LongPrefixes:
    """Starts of files, cut at a line break, whose token count is drawn uniformly from [low, high].

    Only files of at least CHARS_PER_TOKEN_MIN characters a wanted token are tried, and only their first
    CHARS_PER_TOKEN_MAX characters a wanted token are tokenized (code runs about 3), in batches: thousands of
    prompts take seconds, where tokenizing whole files took minutes."""

    CHARS_PER_TOKEN_MIN, CHARS_PER_TOKEN_MAX = 2.5, 5
    BATCH = 512

    def __init__(self, tokenizer: Tokenizer, low: int, high: int):
        self.tokenizer, self.low, self.high = tokenizer, low, high

    def make(self, files: list[dict], count: int, rng: random.Random) -> list[dict]:
        out = []
        candidates = [f["text"] for f in rng.sample(files, len(files))] * PREFIXES_PER_FILE
        for start in range(0, len(candidates), self.BATCH):
            if len(out) >= count:
                break
            wants = [rng.randint(self.low, self.high) for _ in candidates[start:start + self.BATCH]]
            tries = [(t[:w * self.CHARS_PER_TOKEN_MAX], w) for t, w in zip(candidates[start:start + self.BATCH], wants)
                     if len(t) >= w * self.CHARS_PER_TOKEN_MIN]
            if not tries:
                continue
            texts, wants = zip(*tries)
            encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
            for text, want, enc in zip(texts, wants, encoded):
                prefix = self.cut(text, want, enc.offsets)
                if prefix is not None and len(out) < count:
                    out.append({"kind": "long", "prompt": prefix})
        return out

    def cut(self, text: str, want: int, offsets: list[tuple[int, int]]) -> str | None:
        if len(offsets) <= want:
            return None
        cut = text.rfind("\n", 0, offsets[want][0]) + 1  # whole lines that fit in `want` tokens
        n = sum(1 for _, end in offsets if end <= cut)
        return text[:cut] if text[:cut].strip() and self.low <= n <= self.high else None


def mixed_prompts(functions: list[dict], files: list[dict], count: int, mix: dict[str, float], max_chars: int,
                  long_prefix: LongPrefixes, rng: random.Random) -> list[dict]:
    """count prompts in the proportions of mix (kinds in KINDS), each from a distinct function or file where
    there are enough of them. Chat, code and signature prompts are at most max_chars long."""
    want = {kind: round(count * mix.get(kind, 0.0)) for kind in KINDS}
    short = [f for f in functions if len(f["request"]) <= max_chars]
    out = [chat_prompt(f["request"]) for f in rng.sample(short, min(len(short), want["chat"]))]
    signatures = []
    for f in rng.sample(functions, len(functions)):
        if len(signatures) >= want["signature"]:
            break
        prefix = signature_prefix(f["code"], rng)
        if prefix is not None and len(prefix) <= max_chars:
            signatures.append({"kind": "signature", "prompt": prefix})
    out += signatures
    codes = []
    for _ in range(PREFIXES_PER_FILE):  # a second or third prefix per file only when files run short
        for f in rng.sample(files, len(files)):
            if len(codes) >= want["code"]:
                break
            prefix = code_prefix(f["text"], rng, max_chars)
            if prefix is not None:
                codes.append({"kind": "code", "prompt": prefix})
    out += codes + long_prefix.make(files, want["long"], rng)
    rng.shuffle(out)
    return out


def build_prompts(corpus: Path, out: Path, tokenizer: Path, train_count: int, heldout_count: int,
                  max_chars: int = 600, long_tokens: tuple[int, int] = (1000, 3700), seed: int = 0,
                  drafter_source: str = "heldout") -> dict:
    """drafter_source "heldout": the drafter's prompts from the held-out projects that do not measure tau;
    "train": from the target's own training split."""
    if drafter_source not in ("heldout", "train"):
        raise ValueError(f"drafter prompts come from 'heldout' or 'train', not {drafter_source!r}")
    rng = random.Random(seed)
    long_prefix = LongPrefixes(Tokenizer.from_file(str(tokenizer / "tokenizer.json")), *long_tokens)
    functions, files = read_jsonl(corpus / "functions_heldout.jsonl"), read_jsonl(corpus / "heldout.jsonl")
    if drafter_source == "heldout":
        tau = tau_projects({f["project"] for f in files})
        tau_functions = [f for f in functions if f["project"] in tau]
        tau_files = [f for f in files if f["project"] in tau]
        train = mixed_prompts([f for f in functions if f["project"] not in tau],
                              [f for f in files if f["project"] not in tau], train_count, TRAIN_MIX, max_chars,
                              long_prefix, rng)
    else:
        tau_functions, tau_files = functions, files
        train = mixed_prompts(read_jsonl(corpus / "functions_train.jsonl"), read_jsonl(corpus / "train.jsonl"),
                              train_count, TRAIN_MIX, max_chars, long_prefix, rng)
    held_out = mixed_prompts(tau_functions, tau_files, heldout_count, HELD_OUT_MIX, max_chars, long_prefix, rng)
    if not train or not held_out:
        raise ValueError(f"{corpus}: no usable prompts ({len(train)} train, {len(held_out)} held-out)")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout_code.jsonl", held_out)
    write_jsonl(out / "prose.jsonl", [chat_prompt(r) for r in PROSE_REQUESTS])
    kinds = lambda rs: {k: sum(r["kind"] == k for r in rs) for k in KINDS}  # noqa: E731
    return {"train": kinds(train), "drafter_prompts_from": drafter_source, "heldout_code": kinds(held_out),
            "tau_projects": sorted({f["project"] for f in tau_files}), "prose": len(PROSE_REQUESTS)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashdraft.demo.pipeline.prompts", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="folder written by the corpus stage")
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="folder written by the tokenizer stage (sizes the long prompts in tokens)")
    p.add_argument("--out", type=Path, required=True, help="output folder for the prompt files")
    p.add_argument("--train", type=int, default=12000, help="prompts for the drafter's data (default 12000)")
    p.add_argument("--drafter-prompts", choices=["heldout", "train"], default="heldout",
                   help="split the drafter's prompts come from: held-out projects not used for tau (default), or "
                        "the target's training split (which the target recites)")
    p.add_argument("--heldout", type=int, default=48, help="held-out Python prompts for tau (default 48)")
    p.add_argument("--max-chars", type=int, default=600,
                   help="longest chat, code or signature prompt in characters (default 600, about 200 tokens)")
    p.add_argument("--long-tokens", type=int, nargs=2, default=[1000, 3700], metavar=("MIN", "MAX"),
                   help="length range of the long prompts in tokens (default 1000 3700)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    low, high = args.long_tokens
    if args.train < 1 or args.heldout < 1 or args.max_chars < MIN_PREFIX_CHARS or not 1 <= low <= high:
        p.error(f"--train and --heldout must be >= 1, --max-chars >= {MIN_PREFIX_CHARS}, 1 <= --long-tokens MIN <= MAX")
    try:
        stats = build_prompts(args.corpus, args.out, args.tokenizer, args.train, args.heldout, args.max_chars,
                              (low, high), args.seed, args.drafter_prompts)
    except (ValueError, OSError) as e:
        print(f"prompts: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
