"""Where a kernel's warps wait, per SASS instruction, from an Nsight Compute source page.

Reads the CSV that `ncu --import REPORT --page source --csv --print-source sass` writes (plain or gzipped; its first
kernel, where it holds several) and prints the stall reasons' shares over all samples, then the instructions with
the most samples, each with its two largest reasons and the instructions just before it in address order (the load
a wait is on may lie further back: search the page for the register). Runs anywhere: the profile is taken on the
GPU machine (scripts/gpu/kquant_ncu.py), read here.

Usage: python scripts/ncu_stalls.py SOURCE.csv[.gz] [--top 12] [--before 6]
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """The source page's header and instruction rows; ValueError naming the file where it is not such a page."""
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
    rows = list(csv.reader(io.StringIO(text)))
    at = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r and SAMPLES in r), None)
    if at is None:
        raise ValueError(f"{path}: no row with Address, Source and {SAMPLES!r}: not an ncu source page (--page "
                         f"source --csv --print-source sass)")
    header, body = rows[at], []
    for row in rows[at + 1:]:
        if row == header or (row and row[0] == "Kernel Name"):  # the next kernel's page
            break
        if len(row) == len(header):
            body.append(row)
    return header, body


def digest(header: list[str], rows: list[list[str]], top: int, before: int) -> str:
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]

    def count(row: list[str], name: str) -> int:
        value = row[col[name]].strip()
        return int(float(value)) if value else 0

    samples = [count(r, SAMPLES) for r in rows]
    total = sum(samples)
    if total == 0:
        return "no stall samples in this page (was the SourceCounters section collected?)\n"
    lines = [f"{total} samples over {len(rows)} instructions"]
    by_reason = {name: sum(count(r, name) for r in rows) for name in reasons}
    for name, n in sorted(by_reason.items(), key=lambda kv: -kv[1]):
        if n:
            lines.append(f"  {name[6:]:20s} {n:7d}  {100 * n / total:5.1f}%")
    lines.append("")
    for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:top]:
        worst = sorted(((count(rows[i], name), name[6:]) for name in reasons), reverse=True)[:2]
        lines.append(f"{samples[i]:6d} ({100 * samples[i] / total:4.1f}%) {rows[i][col['Source']].strip()}   "
                     + ", ".join(f"{name} {n}" for n, name in worst if n))
        for j in range(max(0, i - before), i):
            lines.append(f"         {samples[j]:5d}  {rows[j][col['Source']].strip()}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--top", type=int, default=12, help="instructions listed, most samples first")
    ap.add_argument("--before", type=int, default=6, help="instructions shown before each")
    args = ap.parse_args()
    try:
        header, rows = read_rows(args.source)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        print(f"ncu_stalls: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(digest(header, rows, args.top, args.before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
