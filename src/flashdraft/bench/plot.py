"""The --plot PNG: baseline vs DFlash tokens per second for each prompt, tau and speedup annotated."""
from __future__ import annotations

from pathlib import Path

# The object-oriented API with the Agg canvas draws without a display and leaves pyplot's global backend alone.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

BASELINE_COLOR, DFLASH_COLOR = "#9aa5b1", "#e4572e"


def write_plot(report: dict, path: str | Path) -> Path:
    rows = report["prompts"] + [{**report["summary"], "name": "all"}]
    names = [r["name"] for r in rows]
    base = [r["baseline_tok_s"] for r in rows]
    fast = [r["dflash_tok_s"] for r in rows]
    width = 0.38
    xs = range(len(rows))

    fig = Figure(figsize=(max(6.0, 1.35 * len(rows) + 2.0), 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar([x - width / 2 for x in xs], base, width, label="baseline (no drafting)", color=BASELINE_COLOR)
    bars = ax.bar([x + width / 2 for x in xs], fast, width, label="DFlash", color=DFLASH_COLOR)
    top = max(base + fast + [1e-9])
    for bar, row in zip(bars, rows):
        ax.annotate(annotation(row), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.axvline(len(rows) - 1.5, color="black", linewidth=0.8, linestyle=":")  # per-prompt bars | overall
    ax.set_ylim(0, top * 1.25)
    ax.set_xticks(list(xs), names, rotation=20 if len(rows) > 5 else 0, ha="right" if len(rows) > 5 else "center")
    ax.set_ylabel("generated tokens / s")
    config = report.get("config", {})
    ax.set_title(title(report["summary"], config), fontsize=10)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def annotation(row: dict) -> str:
    if row.get("empty"):
        return "no tokens\n(excluded)"
    tau = "tau -" if row["tau"] is None else f"tau {row['tau']:.2f}"
    return tau if row["speedup"] is None else f"{tau}\n{row['speedup']:.2f}x"


def title(summary: dict, config: dict) -> str:
    what = config.get("model") or config.get("url") or "flashdraft bench"
    speed = "" if summary["speedup"] is None else f": {summary['speedup']:.2f}x overall"
    return f"{what} — baseline vs DFlash{speed}"
