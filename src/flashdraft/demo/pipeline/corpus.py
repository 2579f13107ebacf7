"""Stage 1, corpus: the .py files of a Python installation, deduplicated, split, plus chat samples.

Files are listed in sorted order and shuffled with a fixed seed, then read until the byte cap is reached, so
the corpus depends only on the installation and the flags. The held-out split is chosen by the file's last
two path components (e.g. `requests/sessions.py`), so vendored copies of one module land in the same split.
Function records (request + source) are extracted with `ast` for the chat samples and the prompts.

    python -m flashdraft.demo.pipeline.corpus --out runs/demo/corpus --max-mb 160
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import re
import site
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pool
from pathlib import Path

# Files that are mostly data (huge tables, minified or generated code) teach the model nothing useful.
MAX_FILE_BYTES = 400_000
MIN_FILE_BYTES = 200
MAX_LINE_CHARS = 1000
# Functions short enough to be one chat answer.
MIN_FUNCTION_LINES, MAX_FUNCTION_LINES, MAX_FUNCTION_CHARS = 3, 60, 2500

REQUEST_TEMPLATES = [
    "Write a Python function `{name}({args})`. {summary}",
    "Implement `{name}` in Python: {summary}",
    "Write a function named `{name}` that does this: {summary}",
    "Write a Python function that does the following. {summary} Call it `{name}`.",
]
PLAIN_REQUEST_TEMPLATES = [
    "Write the function `{name}` from module `{module}`.",
    "Write a Python function `{name}({args})`.",
]


def default_roots() -> list[Path]:
    """The running Python's installation: its standard library and its site-packages folders."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        roots.append(site.getusersitepackages())
    return [Path(r) for r in dict.fromkeys(roots)]


def list_py_files(roots: list[Path]) -> list[Path]:
    """Every .py file under the roots, once (a root inside another root is walked only once)."""
    resolved = sorted({r.resolve() for r in roots if r.is_dir()})
    outer = [r for r in resolved if not any(o != r and o in r.parents for o in resolved)]
    files = []
    for root in outer:
        for folder, _, names in os.walk(root):
            files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(files)


def read_source(path: Path) -> str | None:
    """The file's text, or None if it is not usable training text (size, encoding, very long lines)."""
    try:
        size = path.stat().st_size
        if not MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text or max(len(line) for line in text.splitlines()) > MAX_LINE_CHARS:
        return None
    return text


def module_name(path: Path) -> str:
    """The module's name as far as the last two path components tell (`requests.sessions`, `json.decoder`)."""
    parts = path.with_suffix("").parts[-2:]
    return ".".join(p for p in parts if p not in ("site-packages", "dist-packages") and not p.startswith("python3"))


def is_held_out(path: Path, percent: float) -> bool:
    key = "/".join(path.parts[-2:]).encode()
    return int(hashlib.sha1(key).hexdigest()[:8], 16) % 10_000 < percent * 100


def summary_of(doc: str | None) -> str:
    """The docstring's first sentence, on one line."""
    if not doc:
        return ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", first)
    sentence = match.group(1) if match else first
    return sentence if 10 <= len(sentence) <= 200 else ""


def extract_functions(source: str) -> list[dict]:
    """Functions and methods of a module: name, arguments, docstring summary and source (dedented)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if not MIN_FUNCTION_LINES <= node.end_lineno - start + 1 <= MAX_FUNCTION_LINES:
            continue
        indent = lines[start - 1][:node.col_offset]
        code = "".join(line[len(indent):] if line.startswith(indent) else line
                       for line in lines[start - 1:node.end_lineno])
        if len(code) > MAX_FUNCTION_CHARS:
            continue
        try:
            args = ast.unparse(node.args)
        except (ValueError, RecursionError):
            continue
        out.append({"name": node.name, "args": args, "summary": summary_of(ast.get_docstring(node)),
                    "code": code.rstrip() + "\n"})
    return out


def request_for(fn: dict, module: str, rng: random.Random) -> str:
    """A user message asking for the function, from its docstring when it has one."""
    templates = REQUEST_TEMPLATES if fn["summary"] else PLAIN_REQUEST_TEMPLATES
    return rng.choice(templates).format(module=module, **fn)


def _functions_of(item: tuple[str, str]) -> tuple[str, list[dict]]:
    module, text = item
    return module, extract_functions(text)


def collect_documents(files: list[Path], max_bytes: int, held_out_percent: float, held_out_max_bytes: int,
                      workers: int, deadline: float) -> tuple[list[dict], list[dict], dict]:
    """Read files in the given order until the train split holds max_bytes; dedupe by content."""
    train, held_out, hashes = [], [], set()
    sizes = {"train": 0, "heldout": 0}
    counts = {"listed": len(files), "read": 0, "rejected": 0, "duplicates": 0}
    chunk = max(64, workers * 16)
    with ThreadPoolExecutor(workers) as pool:
        for i in range(0, len(files), chunk):
            if sizes["train"] >= max_bytes or time.monotonic() > deadline:
                break
            batch = files[i:i + chunk]
            for path, text in zip(batch, pool.map(read_source, batch)):
                counts["read"] += 1
                if text is None:
                    counts["rejected"] += 1
                    continue
                digest = hashlib.sha1(text.encode()).digest()
                if digest in hashes:
                    counts["duplicates"] += 1
                    continue
                hashes.add(digest)
                split = "heldout" if is_held_out(path, held_out_percent) else "train"
                limit = held_out_max_bytes if split == "heldout" else max_bytes
                if sizes[split] >= limit:
                    continue
                (held_out if split == "heldout" else train).append({"module": module_name(path), "text": text})
                sizes[split] += len(text.encode())
    counts.update(train_files=len(train), heldout_files=len(held_out), train_bytes=sizes["train"],
                  heldout_bytes=sizes["heldout"])
    return train, held_out, counts


def collect_functions(docs: list[dict], max_bytes: int, rng: random.Random, workers: int,
                      deadline: float) -> list[dict]:
    """Function records with a request each, from docs in order until their code reaches max_bytes."""
    records, total = [], 0
    items = [(d["module"], d["text"]) for d in docs]
    with Pool(workers) as pool:
        for module, functions in pool.imap(_functions_of, items, chunksize=8):
            for fn in functions:
                records.append({"module": module, "request": request_for(fn, module, rng), **fn})
                total += len(fn["code"])
            if total >= max_bytes or time.monotonic() > deadline:
                pool.terminate()
                break
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def build_corpus(out: Path, roots: list[Path], max_bytes: int, held_out_percent: float = 2.0,
                 held_out_max_bytes: int = 8_000_000, chat_fraction: float = 0.15, seed: int = 0,
                 workers: int = 8, max_seconds: float = 120.0) -> dict:
    t0 = time.monotonic()
    deadline = t0 + max_seconds
    files = list_py_files(roots)
    if not files:
        raise ValueError(f"no .py files under {[str(r) for r in roots]}")
    rng = random.Random(seed)
    rng.shuffle(files)
    train, held_out, stats = collect_documents(files, max_bytes, held_out_percent, held_out_max_bytes,
                                               workers, deadline)
    if not train or not held_out:
        raise ValueError(f"corpus too small: {len(train)} train and {len(held_out)} held-out files "
                         f"(raise --max-mb or --held-out-percent, or add --roots)")
    train_functions = collect_functions(train, int(chat_fraction * stats["train_bytes"]), rng, workers, deadline)
    # The held-out split is small: all its functions, whatever time the train split took.
    held_out_functions = collect_functions(held_out, held_out_max_bytes, rng, workers, time.monotonic() + 60)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", held_out)
    write_jsonl(out / "functions_train.jsonl", train_functions)
    write_jsonl(out / "functions_heldout.jsonl", held_out_functions)
    stats.update(train_functions=len(train_functions), heldout_functions=len(held_out_functions),
                 chat_bytes=sum(len(f["code"]) for f in train_functions), seed=seed,
                 roots=[str(r) for r in roots], seconds=round(time.monotonic() - t0, 1))
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashdraft.demo.pipeline.corpus", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--roots", type=Path, nargs="*", default=None,
                   help="folders to search for .py files (default: this Python's prefix and site-packages)")
    p.add_argument("--max-mb", type=float, default=160, help="train split size cap in MB (default 160)")
    p.add_argument("--held-out-percent", type=float, default=2.0, help="share of modules held out (default 2)")
    p.add_argument("--held-out-max-mb", type=float, default=8, help="held-out split size cap in MB (default 8)")
    p.add_argument("--chat-fraction", type=float, default=0.15,
                   help="function sources for chat samples, as a fraction of the train bytes (default 0.15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=8, help="reader threads and parser processes (default 8)")
    p.add_argument("--max-seconds", type=float, default=120, help="wall-clock cap for reading (default 120)")
    args = p.parse_args(argv)
    if args.max_mb <= 0 or not 0 < args.held_out_percent < 100 or not 0 <= args.chat_fraction < 1:
        p.error("--max-mb must be > 0, --held-out-percent in (0, 100) and --chat-fraction in [0, 1)")
    try:
        stats = build_corpus(args.out, args.roots or default_roots(), int(args.max_mb * 1e6),
                             args.held_out_percent, int(args.held_out_max_mb * 1e6), args.chat_fraction,
                             args.seed, max(1, args.workers), args.max_seconds)
    except ValueError as e:
        print(f"corpus: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
