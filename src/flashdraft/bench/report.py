"""Benchmark arithmetic and presentation: per-prompt rows, the summary, the text table.

Throughput is tokens over generation time summed across repetitions (a ratio of sums, so a slow repetition
weighs by its duration); generation time excludes prompt processing, as llama.cpp's predicted_ms does.
tau is committed tokens per decoding step (accepted guesses + 1), acceptance rate is accepted / proposed.
A prompt that generated no tokens (the model ended its reply at once) is flagged and left out of the summary;
repetitions whose tok/s disagree by more than NOISE_LIMIT flag their row as noisy. Time to first token (TTFT) is
the median over repetitions: measured by the client on a streamed response from a server, the prompt's
processing in process (its prefill produces the first token); cached tokens are those a server's prompt cache
served (llama.cpp's cache_n; 0 in process, where every prompt runs cold).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

# Repetitions of one prompt and way whose tok/s differ by more than this fraction (max / min - 1) make the row noisy.
NOISE_LIMIT = 0.10


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
    ttft_ms: float | None = None                # time to the first token (see the module docstring)
    cache_n: int = 0                            # prompt tokens the server's prompt cache served

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


def median_ttft(runs: list[Measurement]) -> float | None:
    values = [r.ttft_ms for r in runs if r.ttft_ms is not None]
    return statistics.median(values) if values else None


def identical(baseline: list[Measurement], dflash: list[Measurement], greedy: bool) -> bool | None:
    """Greedy runs only: every repetition's output equal both ways (token ids when known, else text)."""
    if not greedy:
        return None
    outputs = [r.tokens if r.tokens is not None else r.text for r in baseline + dflash]
    return all(o == outputs[0] for o in outputs)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def spread(rates: list[float]) -> float | None:
    """max / min - 1 of the repetitions' tok/s (those that generated tokens); None with fewer than two."""
    rates = [r for r in rates if r > 0]
    return max(rates) / min(rates) - 1.0 if len(rates) > 1 else None


def noisy(*spreads: float | None) -> bool:
    return any(s is not None and s > NOISE_LIMIT for s in spreads)


def generated_nothing(result: PromptResult) -> bool:
    """No tokens generated in some way (the model ended its reply at once): no throughput to compare."""
    return any(sum(r.predicted_n for r in runs) == 0 for runs in (result.baseline, result.dflash))


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
        "baseline_ttft_ms": median_ttft(baseline),
        "dflash_ttft_ms": median_ttft(dflash),
    }


def prompt_row(result: PromptResult, greedy: bool) -> dict:
    base_spread = spread([tokens_per_second([r]) for r in result.baseline])
    dflash_spread = spread([tokens_per_second([r]) for r in result.dflash])
    return {
        "name": result.name,
        **figures(result.baseline, result.dflash),
        "identical": identical(result.baseline, result.dflash, greedy),
        "prompt_tokens": result.baseline[0].prompt_n + result.baseline[0].cache_n,
        "cache_n": result.dflash[0].cache_n,
        "baseline_tokens": mean([r.predicted_n for r in result.baseline]),
        "dflash_tokens": mean([r.predicted_n for r in result.dflash]),
        "baseline_gen_s": mean([r.predicted_ms for r in result.baseline]) / 1000.0,
        "dflash_gen_s": mean([r.predicted_ms for r in result.dflash]) / 1000.0,
        "reps": len(result.dflash),
        "baseline_spread": base_spread,
        "dflash_spread": dflash_spread,
        "noisy": noisy(base_spread, dflash_spread),
        "empty": generated_nothing(result),
    }


def summary(results: list[PromptResult], greedy: bool) -> dict:
    """Over the prompts that generated tokens: pooled throughput and acceptance; generated tokens and generation
    time per pass over them. The spreads compare whole passes: repetition i of every prompt, pooled."""
    rows = [prompt_row(r, greedy) for r in results]
    kept = [r for r, row in zip(results, rows) if not row["empty"]]
    kept_rows = [row for row in rows if not row["empty"]]
    base = [m for r in kept for m in r.baseline]
    fast = [m for r in kept for m in r.dflash]
    reps = min((len(r.dflash) for r in kept), default=0)
    base_spread = spread([tokens_per_second([r.baseline[i] for r in kept]) for i in range(reps)])
    dflash_spread = spread([tokens_per_second([r.dflash[i] for r in kept]) for i in range(reps)])
    return {
        "prompts": len(kept),
        **figures(base, fast),
        "identical": all(row["identical"] for row in rows) if greedy else None,
        "baseline_tokens": sum(row["baseline_tokens"] for row in kept_rows),
        "dflash_tokens": sum(row["dflash_tokens"] for row in kept_rows),
        "baseline_gen_s": sum(row["baseline_gen_s"] for row in kept_rows),
        "dflash_gen_s": sum(row["dflash_gen_s"] for row in kept_rows),
        "reps": reps,
        "baseline_spread": base_spread,
        "dflash_spread": dflash_spread,
        "noisy": noisy(base_spread, dflash_spread),
        "cache_n": sum(row["cache_n"] for row in kept_rows),
        "noisy_prompts": [row["name"] for row in kept_rows if row["noisy"]],
        "excluded_prompts": [row["name"] for row in rows if row["empty"]],
    }


def build_report(results: list[PromptResult], greedy: bool, config: dict) -> dict:
    return {"prompts": [prompt_row(r, greedy) for r in results], "summary": summary(results, greedy),
            "config": config}


# ---- text table -------------------------------------------------------------------------------------------

COLUMNS = [  # header, width, key, format
    ("prompt", 18, "name", "{}"),
    ("tokens", 6, "dflash_tokens", None),
    ("reps", 4, "reps", "{}"),
    ("base tok/s", 10, "baseline_tok_s", "{:.1f}"),
    ("dflash tok/s", 12, "dflash_tok_s", "{:.1f}"),
    ("speedup", 7, "speedup", "{:.2f}x"),
    ("base s", 7, "baseline_gen_s", "{:.2f}"),
    ("dflash s", 8, "dflash_gen_s", "{:.2f}"),
    ("ttft ms", 7, "dflash_ttft_ms", "{:.0f}"),
    ("cached", 6, "cache_n", "{}"),
    ("tau", 5, "tau", "{:.2f}"),
    ("accept", 6, "acceptance_rate", "{:.1%}"),
    ("same", 4, "identical", None),
    ("spread", 6, "noisy", None),
    ("draft len", 0, "draft_lengths", None),
]
# Cells an excluded row (no tokens generated) leaves blank: its throughput figures mean nothing.
FIGURES = {"baseline_tok_s", "dflash_tok_s", "speedup", "baseline_gen_s", "dflash_gen_s", "tau", "acceptance_rate",
           "noisy"}


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


def format_tokens(row: dict) -> str:
    """Generated tokens per repetition: one number when both ways generated as many (always, greedy)."""
    base, fast = row.get("baseline_tokens"), row.get("dflash_tokens")
    if base is None or fast is None:
        return "-"
    if round(base) == round(fast):
        return f"{fast:.0f}"
    return f"{base:.0f}/{fast:.0f}"


def format_spread(row: dict) -> str:
    """The larger spread of the two ways' repetitions (max / min - 1 of tok/s), with '!' past NOISE_LIMIT."""
    spreads = [s for s in (row["baseline_spread"], row["dflash_spread"]) if s is not None]
    if not spreads:
        return "-"
    return f"{100 * max(spreads):.0f}%" + ("!" if row["noisy"] else "")


def format_cell(row: dict, key: str, fmt: str | None) -> str:
    if row.get("empty") and key in FIGURES:
        return "-"
    value = row[key]
    if key == "identical":
        return "-" if value is None else ("yes" if value else "NO")
    if key == "draft_lengths":
        return "no tokens: excluded" if row.get("empty") else format_draft_lengths(row)
    if key == "dflash_tokens":
        return format_tokens(row)
    if key == "noisy":
        return format_spread(row)
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
    excluded = len(summary_.get("excluded_prompts", []))
    total = summary_["prompts"] + excluded
    name = f"all ({summary_['prompts']})" if not excluded else f"all ({summary_['prompts']} of {total})"
    return table_row({**summary_, "name": name})


def summary_notes(summary_: dict) -> list[str]:
    """Lines under the table: prompts left out of the summary, and repetitions that disagree."""
    notes = []
    excluded = summary_.get("excluded_prompts", [])
    if excluded:
        notes.append(f"note: no tokens generated (the model ended its reply at once) for {', '.join(excluded)}: "
                     "flagged and left out of the overall figures")
    noisy_prompts = summary_.get("noisy_prompts", [])
    if noisy_prompts or summary_.get("noisy"):
        where = ", ".join(noisy_prompts) if noisy_prompts else "the overall figures"
        notes.append(f"warning: repetitions disagree by more than {100 * NOISE_LIMIT:.0f}% in tok/s ({where}; "
                     "see spread): the figures are noisy. Run on a quiet machine or raise --reps")
    return notes


def format_table(report: dict) -> str:
    lines = [table_header()] + [table_row(r) for r in report["prompts"]]
    lines += ["-" * len(lines[0].splitlines()[0]), summary_row(report["summary"])]
    return "\n".join(lines + summary_notes(report["summary"]))
