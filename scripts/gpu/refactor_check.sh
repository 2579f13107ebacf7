#!/usr/bin/env bash
# The H200 check after the loop's restructuring (issue #19: one step function, models built with their plan) and
# sampling inside the captured step (issue #24): the GPU tests of the loop, then the figures to compare with the
# last ones in docs/performance.md (synthetic Qwen3-8B greedy and at the walkthrough's sampling; the Gemma-4-31B
# Q4_K_S run). Two device calls of under 10 minutes each:
#     bash scripts/gpu/refactor_check.sh tests      # about 4 min
#     bash scripts/gpu/refactor_check.sh figures    # about 8 min
# Logs and JSON go to $OUT.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
case "${1:-tests}" in
  tests)
    timeout 500 python -m pytest -q -p no:cacheprovider tests/test_lossless.py tests/test_fused_layers.py \
      tests/test_decode_attention.py tests/test_skinny_gemm.py tests/test_gemma4_target.py tests/test_sampling.py \
      tests/test_warmup.py tests/test_draft_window.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
    ;;
  figures)
    timeout 200 python -m flashdraft.cli bench --synthetic qwen3-8b --json > "$OUT/synthetic_greedy.json" \
      2> "$OUT/synthetic_greedy.log"
    timeout 200 python -m flashdraft.cli bench --synthetic qwen3-8b --temp 0.7 --top-k 64 --top-p 0.95 --seed 1 \
      --json > "$OUT/synthetic_sampled.json" 2> "$OUT/synthetic_sampled.log"
    timeout 240 python scripts/gpu/gguf_run.py "$OUT/gguf" --skip-kernels > "$OUT/gguf_run.log" 2>&1
    tail -12 "$OUT/synthetic_greedy.log" "$OUT/synthetic_sampled.log"; tail -20 "$OUT/gguf_run.log"
    ;;
  *) echo "usage: $0 tests|figures" >&2; exit 2 ;;
esac
