"""The synthetic benchmark's CPU path: random target/drafter of a small shape, oracle acceptance patterns."""
import json

import pytest
import torch

from flashdraft.bench.synthetic import SHAPES, build_synthetic, run
from flashdraft.cli import main


def test_synthetic_report_cpu():
    report = run("tiny", device="cpu", tokens=48, taus=(2, 4, 8), log=lambda s: None)
    assert report.baseline_tok_s > 0 and report.verify_step_ms > 0 and report.draft_step_ms > 0
    rows = {r["tau_planned"]: r for r in report.dflash}
    for tau, row in rows.items():
        # The planted pattern really sets tau (the last steps are cut short by max tokens).
        assert row["tau"] == pytest.approx(tau, rel=0.15)
        assert row["identical"]
        assert row["roofline_tok_s"] > 0
    assert rows[8]["tau"] > rows[2]["tau"]


def test_synthetic_at_depth_counts_the_cache_in_its_roofline():
    shallow = run("tiny", device="cpu", tokens=16, taus=(4,), log=lambda s: None)
    deep = run("tiny", device="cpu", tokens=16, taus=(4,), log=lambda s: None, context=400)
    assert shallow.context == 32 and deep.context == 400
    assert deep.kv_gb > 10 * shallow.kv_gb > 0
    # at the same bandwidth (each run measures its own, which varies from run to run on a busy CPU)
    per_gb_s = [r.baseline_roofline_tok_s / r.bandwidth_gb_s for r in (deep, shallow)]
    assert per_gb_s[0] < per_gb_s[1]
    assert per_gb_s[0] == pytest.approx(1 / (deep.target_gb + deep.kv_gb))
    assert deep.dflash[0]["identical"]


def test_synthetic_target_has_large_margins():
    """The random target's greedy next token is a fixed permutation of the current one, with big margins."""
    target, _ = build_synthetic("tiny", torch.device("cpu"), torch.float32, 64)
    ids = torch.randint(0, 512, (20,))
    logits, _ = target(ids, torch.arange(20), target.new_cache(128), 20)
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) > 1.0).all()


def test_synthetic_cli_json(capsys):
    assert main(["bench", "--synthetic", "tiny", "-n", "24", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"] == "tiny" and len(out["dflash"]) == 5
    assert main(["bench", "--synthetic", "nope", "--device", "cpu"]) == 1
    assert "unknown synthetic shape" in capsys.readouterr().err


def test_published_shapes_present():
    assert {"qwen3-8b", "llama-3.1-8b"} <= set(SHAPES)
