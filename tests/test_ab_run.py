"""scripts/gpu/ab_run.sh on the CPU: a missing baseline refused, and the whole A/B run (the working tree against a
baseline tree, here a copy of it) on make_gguf.py's tiny Gemma-4 file, each tree's measurement in its own JSON and
one summary line each."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_gguf_side_by_side import BENCH, fake_bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "ab_run.sh"


def run_ab(env_extra, timeout=900):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **env_extra)
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=timeout)


def test_a_missing_baseline_is_refused(tmp_path):
    proc = run_ab({"OUT": str(tmp_path / "out"), "AB_BASE": str(tmp_path / "nowhere")})
    assert proc.returncode == 2 and "no baseline package" in proc.stderr, proc.stderr


@pytest.mark.skipif(not (BENCH / "make_gguf.py").is_file(), reason=f"{BENCH / 'make_gguf.py'} not found")
def test_both_trees_measured_on_the_same_tiny_file(tmp_path):
    base = tmp_path / "base" / "src"
    shutil.copytree(ROOT / "src", base, ignore=shutil.ignore_patterns("*.safetensors", "__pycache__", "*.egg-info"))
    out = tmp_path / "out"
    bench = fake_bench(tmp_path / "bench", BENCH / "make_gguf.py")
    env = {"OUT": str(out), "AB_BASE": str(base), "SBS_BENCH": str(bench),
           "SBS_WORK": str(tmp_path / "w"), "SBS_GGUF_DIR": str(tmp_path / "g"), "AB_MODELS": "tiny-gemma4:q4_k_s",
           "AB_ROUNDS": "1", "AB_NEED_S": "0", "AB_PREFILL": "32", "AB_TAUS": "4", "AB_TOKENS": "8",
           "AB_DFLASH_PROMPT": "24", "AB_CACHE_TYPES": "q5_0,q4_1"}
    proc = run_ab(env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {tree: json.loads((out / f"{tree}-1-tiny-gemma4__q4_k_s.json").read_text()) for tree in ("base", "new")}
    for tree, run in runs.items():
        assert run["errors"] == [] and [r["depth"] for r in run["plain"]] == [0], tree
        assert run["cache_types"] == "q5_0,q4_1"  # the walkthrough's KV cache types, for both trees
        assert [r["prompt_n"] for r in run["prefill"]] == [32]
        assert [(r["prompt_n"], r["identical"]) for r in run["dflash"]] == [(24, True)]
    lines = (out / "ab_summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == ["base-1-tiny-gemma4__q4_k_s", "new-1-tiny-gemma4__q4_k_s"]
    assert all("same=True" in line and "errors 0" in line for line in lines)
    assert (tmp_path / "g" / "tiny-gemma4__q4_k_s.gguf").is_file()  # kept for both trees
