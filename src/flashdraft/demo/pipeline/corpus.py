"""Stage 1, corpus: the .py files of a Python installation, deduplicated, split, plus chat samples.

Files are listed in sorted order and shuffled with a fixed seed, then read until the byte cap is reached, so
the corpus depends only on the installation and the flags. The held-out split is made of whole projects (the
top-level package under site-packages, e.g. `sympy`; the standard library is one project), so the drafter's
prompts and the tau prompts come from code whose authors and style the target never saw, not only from other
modules of projects it trained on. Function records (request + source) are extracted with `ast` for the chat
samples and the prompts.

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


def list_py_files(roots: list[Path]) -> dict[Path, str]:
    """Every .py file under the roots, once (a root inside another root is walked only once), with its
    project (project_name)."""
    resolved = sorted({r.resolve() for r in roots if r.is_dir()})
    outer = [r for r in resolved if not any(o != r and o in r.parents for o in resolved)]
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = {}
    for root in outer:
        for folder, _, names in os.walk(root):
            for n in names:
                if n.endswith(".py"):
                    path = Path(folder, n)
                    files[path] = project_name(path, root, stdlib)
    return dict(sorted(files.items()))


def project_name(path: Path, root: Path, stdlib: Path) -> str:
    """The project a file belongs to: the top-level name after the last site-packages (`numpy`, `six` for
    six.py, leading underscores dropped so `_pytest` goes with `pytest`), `stdlib` for the rest of the standard
    library, else the first path component under the root it was found in."""
    parts = path.parts
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in ("site-packages", "dist-packages"):
            return Path(parts[i + 1]).stem.lstrip("_") or parts[i + 1]
    if stdlib in path.parents:
        return "stdlib"
    rel = path.relative_to(root).parts
    return Path(rel[0]).stem.lstrip("_") or rel[0]


def project_hash(project: str) -> int:
    return int(hashlib.sha1(project.encode()).hexdigest()[:8], 16)


def held_out_projects(files: dict[Path, str], percent: float, max_bytes: int) -> list[str]:
    """Whole projects, in a stable hash order, until they hold percent of the listed bytes (at most max_bytes).

    A project that would overshoot that target by more than a quarter is skipped, so one large project (torch,
    the standard library) never empties the target's training data."""
    sizes: dict[str, int] = {}
    for path, project in files.items():
        try:
            sizes[project] = sizes.get(project, 0) + path.stat().st_size
        except OSError:
            continue
    target = min(percent / 100 * sum(sizes.values()), max_bytes)
    chosen, total = [], 0
    for project in sorted(sizes, key=lambda p: (project_hash(p), p)):
        if total >= target:
            break
        if total + sizes[project] <= 1.25 * target:
            chosen.append(project)
            total += sizes[project]
    return chosen


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


def _functions_of(item: tuple[str, str, str]) -> tuple[str, str, list[dict]]:
    project, module, text = item
    return project, module, extract_functions(text)


def collect_documents(files: list[Path], projects: dict[Path, str], held_out: set[str], max_bytes: int,
                      held_out_max_bytes: int, workers: int, deadline: float) -> tuple[list[dict], list[dict], dict]:
    """Read files in the given order until each split holds its bytes (max_bytes for train, held_out_max_bytes
    for the held-out projects), or the listing ends; dedupe by content across both splits."""
    train, held_docs, hashes = [], [], set()
    sizes = {"train": 0, "heldout": 0}
    limits = {"train": max_bytes, "heldout": held_out_max_bytes}
    counts = {"listed": len(files), "read": 0, "rejected": 0, "duplicates": 0}
    split_of = {path: "heldout" if projects[path] in held_out else "train" for path in files}
    chunk = max(64, workers * 16)
    with ThreadPoolExecutor(workers) as pool:
        for i in range(0, len(files), chunk):
            if all(sizes[s] >= limits[s] for s in sizes) or time.monotonic() > deadline:
                break
            batch = [path for path in files[i:i + chunk] if sizes[split_of[path]] < limits[split_of[path]]]
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
                split = split_of[path]
                if sizes[split] >= limits[split]:
                    continue
                doc = {"project": projects[path], "module": module_name(path), "text": text}
                (held_docs if split == "heldout" else train).append(doc)
                sizes[split] += len(text.encode())
    counts.update(train_files=len(train), heldout_files=len(held_docs), train_bytes=sizes["train"],
                  heldout_bytes=sizes["heldout"])
    return train, held_docs, counts


FUNCTION_CHUNK = 256  # documents parsed per round of the pool


def collect_functions(docs: list[dict], max_bytes: int, rng: random.Random, workers: int,
                      deadline: float) -> list[dict]:
    """Function records with a request each, from docs in order until their code reaches max_bytes.

    Documents go to the pool in rounds that finish whole, and the pool is closed and joined, never terminated
    with work in flight: terminating a pool in the middle of imap hung the GPU build once (a worker killed
    while it held the task queue's lock)."""
    records, total = [], 0
    items = [(d["project"], d["module"], d["text"]) for d in docs]
    pool = Pool(workers)
    try:
        for start in range(0, len(items), FUNCTION_CHUNK):
            if total >= max_bytes or time.monotonic() > deadline:
                break
            for project, module, functions in pool.map(_functions_of, items[start:start + FUNCTION_CHUNK],
                                                        chunksize=4):
                for fn in functions:
                    records.append({"project": project, "module": module,
                                    "request": request_for(fn, module, rng), **fn})
                    total += len(fn["code"])
    finally:
        pool.close()
        pool.join()
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
    projects = list_py_files(roots)
    if not projects:
        raise ValueError(f"no .py files under {[str(r) for r in roots]}")
    held_out_names = held_out_projects(projects, held_out_percent, held_out_max_bytes)
    files = list(projects)
    rng = random.Random(seed)
    rng.shuffle(files)
    train, held_out, stats = collect_documents(files, projects, set(held_out_names), max_bytes,
                                               held_out_max_bytes, workers, deadline)
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
                 heldout_projects=sorted({d["project"] for d in held_out}),
                 roots=[str(r) for r in roots], seconds=round(time.monotonic() - t0, 1))
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashdraft.demo.pipeline.corpus", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--roots", type=Path, nargs="*", default=None,
                   help="folders to search for .py files (default: this Python's prefix and site-packages)")
    p.add_argument("--max-mb", type=float, default=160, help="train split size cap in MB (default 160)")
    p.add_argument("--held-out-percent", type=float, default=2.0,
                   help="share of the listed bytes held out, as whole projects (default 2)")
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
