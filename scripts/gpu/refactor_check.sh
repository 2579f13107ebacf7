#!/usr/bin/env bash
# The H200 check after the loop's restructuring (issue #19: one step function, models built with their plan) and
# sampling inside the captured step (issue #24): the GPU tests of the loop, then the figures to compare with the
# last ones in docs/performance.md (synthetic Qwen3-8B greedy and at the walkthrough's sampling; the Gemma-4-31B
# Q4_K_S run). Two device calls of under 10 minutes each:
#     bash scripts/gpu/refactor_check.sh tests      # about 9 min (2026-12-02: 8.4 min and more)
#     bash scripts/gpu/refactor_check.sh figures    # about 5 min
# Logs and JSON go to $OUT.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
case "${1:-tests}" in
  tests)
    timeout 560 python -m pytest -q -p no:cacheprovider tests/test_lossless.py tests/test_fused_layers.py \
      tests/test_decode_attention.py tests/test_skinny_gemm.py tests/test_gemma4_target.py tests/test_sampling.py \
      tests/test_warmup.py tests/test_draft_window.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
    ;;
  figures)
    # sampled first: the walkthrough's settings against greedy, in one run
    timeout 80 python -m flashdraft.cli bench --synthetic qwen3-8b --temp 0.7 --top-k 64 --top-p 0.95 --seed 1 \
      --json > "$OUT/synthetic_sampled.json" 2> "$OUT/synthetic_sampled.log"
    timeout 80 python -m flashdraft.cli bench --synthetic qwen3-8b --json > "$OUT/synthetic_greedy.json" \
      2> "$OUT/synthetic_greedy.log"
    # REFERENCE: another engine/speculative.py (its sampling) to compare tokens with (an older commit's, e.g. git show REV:PATH)
    timeout 60 python scripts/gpu/sampling_cost.py ${REFERENCE:+--reference "$REFERENCE"} > "$OUT/sampling_cost.log" 2>&1
    timeout 170 python scripts/gpu/gguf_run.py "$OUT/gguf" --skip-kernels --budget-s 110 > "$OUT/gguf_run.log" 2>&1
    tail -8 "$OUT/synthetic_greedy.log" "$OUT/synthetic_sampled.log"; cat "$OUT/sampling_cost.log"
    grep "^(c)" "$OUT/gguf_run.log" | tail -12
    ;;
  *) echo "usage: $0 tests|figures" >&2; exit 2 ;;
esac
