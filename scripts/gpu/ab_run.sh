#!/usr/bin/env bash
# flashdraft against itself: the working tree and a baseline tree on the same GGUF files in one device run, each
# measured by side_by_side_gguf.py (plain decode, prefill, DFlash with its same-tokens check), in turns (per model
# base, then new; all of it AB_ROUNDS times while time is left), so that a change's effect is a ratio on one card.
# No llama.cpp: a claim against it comes from side_by_side.sh.
#
# Usage, from the repository root on the GPU machine (results and logs go to $OUT):
#     bash scripts/gpu/ab_run.sh
# The baseline is the flashdraft package at $AB_BASE (default .ab/base/src: `git archive REV src | tar -x -C
# .ab/base`, its demo weights left out; .ab is ignored by git, so carry it). Knobs: AB_MODELS ("qwen3-8b:q4_k_m",
# as side_by_side.sh's SBS_MODELS), AB_ROUNDS (2), AB_BUDGET_S (540), AB_NEED_S (150: the seconds a measurement
# must have left to start), AB_TESTS (pytest arguments run first on the working tree, e.g.
# "tests/test_mma_kernels.py"; none by default), and the measurement's: AB_DEPTHS (0), AB_PREFILL (512), AB_TAUS
# (6; empty: no DFlash), AB_DFLASH_PROMPT (512), AB_TOKENS (128), AB_CACHE_TYPES (K,V: the target's KV cache
# types, e.g. q5_0,q4_1; empty: the compute dtype); side_by_side.sh's SBS_BENCH, SBS_WORK and
# SBS_GGUF_DIR say where the files come from and go. Exit codes: 0 done; 2 no baseline; 3 out of time (what was
# measured is in $OUT); 4 the files could not be written.
set -uo pipefail

T0=$(date +%s)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:?set OUT}"
BASE="${AB_BASE:-$ROOT/.ab/base/src}"
MODELS="${AB_MODELS:-qwen3-8b:q4_k_m}"
ROUNDS="${AB_ROUNDS:-2}"
BUDGET="${AB_BUDGET_S:-540}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
LOG="$OUT/ab.log"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
say() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

summary() {  # one line a measurement: its plain, prefill and DFlash figures (and whether DFlash gave plain's tokens)
    "$PY" - "$OUT" <<'PY' | tee "$OUT/ab_summary.txt"
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*-*-*.json"), key=lambda f: f.stem.split("-", 2)[::-1]):  # model, round, tree
    d = json.loads(f.read_text())
    plain = " ".join(f"d{r['depth']} {r['tok_s']:.1f}" for r in d.get("plain", []))
    pre = " ".join(f"pp{r['prompt_n']} {r['tok_s']:.0f}" for r in d.get("prefill", []))
    dfl = " ".join(f"DFlash@{r['prompt_n']} tau {r['tau']:.2f} {r['tok_s']:.1f} same={r['identical']}"
                   for r in d.get("dflash", []))
    print(f"{f.stem}: plain {plain}; {pre}; {dfl}; errors {len(d.get('errors', []))}")
PY
}

[ -d "$BASE/flashdraft" ] || { echo "ab_run.sh: no baseline package at $BASE/flashdraft" >&2; exit 2; }
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >> "$LOG" 2>&1
say "ab_run.sh: models $MODELS; rounds $ROUNDS; baseline $BASE"
# the files, by side_by_side.sh's files phase (kept: both trees read them), and its gguf-py, which both trees
# load them with (carry .llamacpp-bench's beellama-src.tar.gz and make_gguf.py)
SBS_MODELS="$MODELS" SBS_KEEP_GGUF=1 SBS_BUDGET_S=$(( $(left) - 30 )) OUT="$OUT/files" \
    bash "$ROOT/scripts/gpu/side_by_side.sh" files >> "$LOG" 2>&1 || { say "files: failed"; exit 4; }
SITE=$(bash "$ROOT/scripts/gpu/side_by_side.sh" --print-gguf-py)
if [ -n "${AB_TESTS:-}" ]; then
    say "tests: $AB_TESTS"
    # shellcheck disable=SC2086
    PYTHONPATH="$ROOT/src:$SITE" timeout $(( $(left) / 3 )) "$PY" -m pytest -q $AB_TESTS > "$OUT/gpu_tests.log" 2>&1
    say "tests: status $? ($(tail -1 "$OUT/gpu_tests.log"))"
fi
for round in $(seq 1 "$ROUNDS"); do
    for spec in $MODELS; do
        nm="${spec%%:*}__${spec##*:}" tiny=()
        case "$spec" in tiny-*) tiny=(--tiny);; esac  # make_gguf.py's tiny shapes take tiny drafters
        for tree in base new; do
            src="$ROOT/src"; [ $tree = base ] && src="$BASE"
            [ "$(left)" -ge "${AB_NEED_S:-150}" ] || { say "out of time before $tree round $round"; summary; exit 3; }
            say "$tree round $round: $nm"
            PYTHONPATH="$src:$SITE" timeout $(( $(left) - 10 )) "$PY" "$ROOT/scripts/gpu/side_by_side_gguf.py" \
                measure "${SBS_GGUF_DIR:-/tmp/sbs-gguf}/$nm.gguf" "$OUT/$tree-$round-$nm.json" \
                --depths "${AB_DEPTHS:-0}" --prefill "${AB_PREFILL:-512}" --taus "${AB_TAUS-6}" \
                --dflash-prompt "${AB_DFLASH_PROMPT:-512}" --tokens "${AB_TOKENS:-128}" \
                --cache-types "${AB_CACHE_TYPES:-}" "${tiny[@]}" 2>&1 \
                | tee -a "$LOG"
        done
    done
done
say "done"
summary
