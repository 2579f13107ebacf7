#!/usr/bin/env bash
# The H200 check after the loop's restructuring (issue #19: one step function, models built with their plan) and
# sampling inside the captured step (issue #24): the GPU tests of the loop, then the figures to compare with the
# last ones in docs/performance.md (synthetic Qwen3-8B greedy and at the walkthrough's sampling; the demo
# pair's 40-prompt greedy identity; the Gemma-4-31B Q4_K_S run). Two device calls of under 10 minutes each:
#     bash scripts/gpu/refactor_check.sh tests      # about 5-9 min; carry .whl (gguf's wheel) for tests/test_gguf.py
#     bash scripts/gpu/refactor_check.sh figures    # about 8 min
# Logs and JSON go to $OUT.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
case "${1:-tests}" in
  tests)
    # the GGUF tests compare with gguf-py, which the GPU machine lacks: carry its wheel in .whl (device README)
    if ls .whl/gguf-*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl &&
        export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    timeout 560 python -m pytest -q -p no:cacheprovider tests/test_lossless.py tests/test_fused_layers.py \
      tests/test_decode_attention.py tests/test_skinny_gemm.py tests/test_gemma4_target.py tests/test_sampling.py \
      tests/test_warmup.py tests/test_draft_window.py tests/test_gguf.py tests/test_batched_fused.py \
      tests/test_batched_step.py tests/test_qkv_prep.py > "$OUT/gpu_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log"; tail -n 3 "$OUT/gpu_tests.log"
    ;;
  figures)
    # sampled first: the walkthrough's settings against greedy, in one run
    timeout 80 python -m flashdraft.cli bench --synthetic qwen3-8b --temp 0.7 --top-k 64 --top-p 0.95 --seed 1 \
      --json > "$OUT/synthetic_sampled.json" 2> "$OUT/synthetic_sampled.log"
    timeout 80 python -m flashdraft.cli bench --synthetic qwen3-8b --json > "$OUT/synthetic_greedy.json" \
      2> "$OUT/synthetic_greedy.log"
    # the greedy identity on the demo pair: 40 prompts, plain against DFlash, token by token
    timeout 150 python scripts/gpu/side_by_side.py src/flashdraft/demo/target src/flashdraft/demo/drafter \
      "$OUT/demo" > "$OUT/demo_identity.log" 2>&1
    # REFERENCE: another engine/speculative.py (its sampling) to compare tokens with (an older commit's, e.g. git show
    # REV:PATH); the sampling kernels' cost is timed only then
    [ -n "${REFERENCE:-}" ] && timeout 60 python scripts/gpu/sampling_cost.py --reference "$REFERENCE" \
      > "$OUT/sampling_cost.log" 2>&1
    timeout 200 python scripts/gpu/gguf_run.py "$OUT/gguf" --skip-kernels --budget-s 150 > "$OUT/gguf_run.log" 2>&1
    tail -n 8 "$OUT/synthetic_greedy.log" "$OUT/synthetic_sampled.log"; grep -A8 "^greedy identity" "$OUT/demo_identity.log"
    grep "^(c)" "$OUT/gguf_run.log" | tail -12
    ;;
  *) echo "usage: $0 tests|figures" >&2; exit 2 ;;
esac
