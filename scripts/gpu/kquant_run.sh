#!/usr/bin/env bash
# Issue #18: the CUDA k-quant kernel (kquant_mma.cu), the fused projections and the prefill path on the H200, in one
# device call:
#   1. the GPU tests: the kernel (results against dequantize + matmul, batch invariance, rings' bits), the quantized
#      Linear's kernels (Triton, the dequantized copy of prefill passes), the fused layer paths (a GGUF Qwen3's
#      quant_forward), Gemma 4 and GGUF Qwen3 rows bitwise independent of the block; then invariance_check.py on a
#      full-size Qwen3-8B Q4_K_M file, and gguf_profile.py's per-kernel profile of that file's steps
#   2. scripts/gpu/gguf_profile.py on the Q4_K_S-shaped Gemma-4-31B: per-kernel time of a plain step, a verify
#      step and a 512-token prefill pass (eager), by kernel family, and the graphed steps' times; KQ_PROFILE_S
#      seconds at most
#   3. scripts/gpu/mma_tilings.py on KQ_SETS (direct loads and rings; KQ_TILING_S seconds at most), for TILINGS
#     bash scripts/gpu/kquant_run.sh     # logs and JSON to $OUT; carry .whl (device/README.md) and .llamacpp-bench
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1  # gguf (for the tests), from .whl
OUT=${OUT:-/tmp/out}
SETS=${KQ_SETS:-gemma-q4k-fused,qwen-q4k-fused,qwen-q4k,qwen-q6k}
PROFILE_S=${KQ_PROFILE_S:-150}
TILING_S=${KQ_TILING_S:-60}
mkdir -p "$OUT"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_mma_kernels.py tests/test_gguf_quant.py \
  tests/test_rms_norm_rows.py tests/test_fused_layers.py \
  "tests/test_decode_attention.py::test_gemma4_target_rows_are_bitwise_independent_of_the_block" 2>&1 | tail -6
if [ -f .llamacpp-bench/make_gguf.py ]; then  # the Qwen3 Q4_K_M target's rows in a block against alone, full size
  python3 .llamacpp-bench/make_gguf.py --shape qwen3-8b --type q4_k_m -o /tmp/kq-qwen.gguf 2>&1 | tail -1
  timeout 90 python scripts/gpu/invariance_check.py /tmp/kq-qwen.gguf 2>&1 | grep -E "MISMATCH|checked|target"
  timeout 90 python scripts/gpu/gguf_profile.py "$OUT/profile-qwen" /tmp/kq-qwen.gguf > "$OUT/qwen_profile.log" 2>&1
  grep -v -i warn "$OUT/qwen_profile.log" | grep -E "step|ms|rror" | head -40
  rm -f /tmp/kq-qwen.gguf
fi
timeout "$PROFILE_S" python scripts/gpu/gguf_profile.py "$OUT/profile" > "$OUT/gguf_profile.log" 2>&1
grep -v -i warn "$OUT/gguf_profile.log" | grep -E "step|prefill|ms|rror" | head -60
timeout $(( TILING_S + 60 )) python scripts/gpu/mma_tilings.py "$OUT" --only "$SETS" --budget-s "$TILING_S" \
  > "$OUT/mma_tilings.log" 2>&1
grep -v -i warn "$OUT/mma_tilings.log" | grep -E "best|MmaTiling|budget|rror|}" | head -30
