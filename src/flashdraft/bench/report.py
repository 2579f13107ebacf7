"""Benchmark arithmetic and presentation: per-prompt rows, the summary, the text table.

Throughput is tokens over generation time summed across repetitions (a ratio of sums, so a slow repetition
weighs by its duration); generation time excludes prompt processing, as llama.cpp's predicted_ms does.
tau is committed tokens per decoding step (accepted guesses + 1), acceptance rate is accepted / proposed.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Measurement:
    """One generation, plain or DFlash, as the engine or a server's `timings` reported it."""

    predicted_n: int
    predicted_ms: float
    prompt_n: int
    prompt_ms: float
    text: str
    draft_n: int = 0
    draft_n_accepted: int = 0
    steps: int | None = None                    # decoding steps; None when the source does not say (servers)
    draft_lengths: dict[int, int] | None = None  # draft length -> steps; None when the source does not say
    tokens: list[int] | None = None             # token ids; None when the source does not say (servers)

    @property
    def decode_steps(self) -> int:
        """Decoding steps. Servers do not report them: the prefill commits one token and each step commits its
        accepted guesses plus one, so steps = tokens - 1 - accepted (exact unless EOS or the token limit cut
        the last step short)."""
        if self.steps is not None:
            return self.steps
        return max(1, self.predicted_n - 1 - self.draft_n_accepted)


@dataclass
class PromptResult:
    """All timed repetitions of one prompt (one conversation turn), both ways."""

    name: str
    baseline: list[Measurement]
    dflash: list[Measurement]


def tokens_per_second(runs: list[Measurement]) -> float:
    ms = sum(r.predicted_ms for r in runs)
    return 1000.0 * sum(r.predicted_n for r in runs) / ms if ms > 0 else 0.0


def speedup(baseline_tok_s: float, dflash_tok_s: float) -> float | None:
    return dflash_tok_s / baseline_tok_s if baseline_tok_s > 0 else None


def tau(runs: list[Measurement]) -> float | None:
    steps = sum(r.decode_steps for r in runs)
    return (sum(r.draft_n_accepted for r in runs) + steps) / steps if steps else None


def acceptance_rate(runs: list[Measurement]) -> float | None:
    proposed = sum(r.draft_n for r in runs)
    return sum(r.draft_n_accepted for r in runs) / proposed if proposed else None


def draft_lengths(runs: list[Measurement]) -> dict[int, int] | None:
    """Steps per draft length over all runs, or None when a run's source does not report it."""
    if any(r.draft_lengths is None for r in runs):
        return None
    merged: dict[int, int] = {}
    for r in runs:
        for length, steps in r.draft_lengths.items():
            merged[length] = merged.get(length, 0) + steps
    return dict(sorted(merged.items()))


def mean_draft_length(runs: list[Measurement]) -> float | None:
    """Proposed tokens per decoding step (0 for steps that did not draft)."""
    steps = sum(r.decode_steps for r in runs)
    return sum(r.draft_n for r in runs) / steps if steps else None


def identical(baseline: list[Measurement], dflash: list[Measurement], greedy: bool) -> bool | None:
    """Greedy runs only: every repetition's output equal both ways (token ids when known, else text)."""
    if not greedy:
        return None
    outputs = [r.tokens if r.tokens is not None else r.text for r in baseline + dflash]
    return all(o == outputs[0] for o in outputs)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def figures(baseline: list[Measurement], dflash: list[Measurement]) -> dict:
    """The numbers shared by a prompt row and the summary."""
    base, fast = tokens_per_second(baseline), tokens_per_second(dflash)
    lengths = draft_lengths(dflash)
    return {
        "baseline_tok_s": base,
        "dflash_tok_s": fast,
        "speedup": speedup(base, fast),
        "tau": tau(dflash),
        "acceptance_rate": acceptance_rate(dflash),
        "draft_n": sum(r.draft_n for r in dflash),
        "draft_n_accepted": sum(r.draft_n_accepted for r in dflash),
        "mean_draft_length": mean_draft_length(dflash),
        "draft_lengths": None if lengths is None else {str(k): v for k, v in lengths.items()},
    }


def prompt_row(result: PromptResult, greedy: bool) -> dict:
    return {
        "name": result.name,
        **figures(result.baseline, result.dflash),
        "identical": identical(result.baseline, result.dflash, greedy),
        "prompt_tokens": result.baseline[0].prompt_n,
        "baseline_tokens": mean([r.predicted_n for r in result.baseline]),
        "dflash_tokens": mean([r.predicted_n for r in result.dflash]),
        "baseline_gen_s": mean([r.predicted_ms for r in result.baseline]) / 1000.0,
        "dflash_gen_s": mean([r.predicted_ms for r in result.dflash]) / 1000.0,
    }


def summary(results: list[PromptResult], greedy: bool) -> dict:
    """Over all prompts: pooled throughput and acceptance; generation time per pass over the prompt set."""
    rows = [prompt_row(r, greedy) for r in results]
    base = [m for r in results for m in r.baseline]
    fast = [m for r in results for m in r.dflash]
    return {
        "prompts": len(results),
        **figures(base, fast),
        "identical": all(row["identical"] for row in rows) if greedy else None,
        "baseline_gen_s": sum(row["baseline_gen_s"] for row in rows),
        "dflash_gen_s": sum(row["dflash_gen_s"] for row in rows),
    }


def build_report(results: list[PromptResult], greedy: bool, config: dict) -> dict:
    return {"prompts": [prompt_row(r, greedy) for r in results], "summary": summary(results, greedy),
            "config": config}


# ---- text table -------------------------------------------------------------------------------------------

COLUMNS = [  # header, width, key, format
    ("prompt", 18, "name", "{}"),
    ("base tok/s", 10, "baseline_tok_s", "{:.1f}"),
    ("dflash tok/s", 12, "dflash_tok_s", "{:.1f}"),
    ("speedup", 7, "speedup", "{:.2f}x"),
    ("base s", 7, "baseline_gen_s", "{:.2f}"),
    ("dflash s", 8, "dflash_gen_s", "{:.2f}"),
    ("tau", 5, "tau", "{:.2f}"),
    ("accept", 6, "acceptance_rate", "{:.1%}"),
    ("same", 4, "identical", None),
    ("draft len", 0, "draft_lengths", None),
]


def format_draft_lengths(row: dict) -> str:
    lengths = row["draft_lengths"]
    if lengths is None:
        return "-" if row["mean_draft_length"] is None else f"avg {row['mean_draft_length']:.1f}"
    used = sorted(int(k) for k in lengths)
    if not used:  # no decoding step: the prefill's token was the only one (a full context, or -n 1)
        return "-"
    if len(used) == 1:
        return str(used[0])
    return f"{used[0]}-{used[-1]} avg {row['mean_draft_length']:.1f}"


def format_cell(row: dict, key: str, fmt: str | None) -> str:
    value = row[key]
    if key == "identical":
        return "-" if value is None else ("yes" if value else "NO")
    if key == "draft_lengths":
        return format_draft_lengths(row)
    if value is None:
        return "-"
    return fmt.format(value)


def format_line(cells: list[str]) -> str:
    parts = []
    for (_, width, key, _), cell in zip(COLUMNS, cells):
        parts.append(cell.ljust(width) if key == "name" else cell.rjust(width))
    return "  ".join(parts).rstrip()


def table_header() -> str:
    head = format_line([c[0] for c in COLUMNS])
    return head + "\n" + "-" * len(head)


def table_row(row: dict) -> str:
    name = row["name"]
    cells = [name if len(name) <= 18 else name[:17] + "~"]
    cells += [format_cell(row, key, fmt) for _, _, key, fmt in COLUMNS[1:]]
    return format_line(cells)


def summary_row(summary_: dict) -> str:
    return table_row({**summary_, "name": f"all ({summary_['prompts']})"})


def format_table(report: dict) -> str:
    lines = [table_header()] + [table_row(r) for r in report["prompts"]]
    lines += ["-" * len(lines[0].splitlines()[0]), summary_row(report["summary"])]
    return "\n".join(lines)
