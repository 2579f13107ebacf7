#!/usr/bin/env bash
# Issue #18: the CUDA k-quant kernel for Q5_K and Q6_K (kquant_mma.cu) on the H200, in one device call:
#   1. the GPU tests of the kernel (Q4_K, Q5_K, Q6_K: results against dequantize + matmul, batch invariance)
#   2. scripts/gpu/mma_tilings.py on the Q5_K / Q6_K shapes of Gemma-4-31B Q4_K_S and Qwen3-8B Q4_K_M (direct
#      loads; KQ_SETS, KQ_TILING_S seconds at most)
#   3. scripts/gpu/gguf_run.py --skip-kernels on the Q4_K_S-shaped Gemma-4-31B with those tilings (step times,
#      baseline and DFlash tok/s, same tokens), to set beside docs/performance.md's 12.53 ms decode step
#     bash scripts/gpu/kquant_run.sh     # logs and JSON to $OUT; carry .whl (device/README.md) for gguf
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1  # gguf (for the tests), from .whl
OUT=${OUT:-/tmp/out}
SETS=${KQ_SETS:-gemma-q5k,gemma-q6k,qwen-q6k}
mkdir -p "$OUT"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_mma_kernels.py 2>&1 | tail -6
timeout $(( ${KQ_TILING_S:-150} + 60 )) python scripts/gpu/mma_tilings.py "$OUT" --only "$SETS" --no-rings \
  --budget-s "${KQ_TILING_S:-150}" > "$OUT/mma_tilings.log" 2>&1
grep -v -i warn "$OUT/mma_tilings.log" | grep -E "best|TILINGS|MmaTiling|Error|budget|}" | head -40
timeout "${KQ_MODEL_S:-270}" python scripts/gpu/gguf_run.py "$OUT/model" --skip-kernels \
  --mma-tilings "$OUT/mma_tilings.json" --budget-s $(( ${KQ_MODEL_S:-270} - 30 )) > "$OUT/gguf_model.log" 2>&1
grep -E "^\(c\) (baseline|steps|DFlash)|tilings from|peak memory|checks|error" "$OUT/gguf_model.log"
