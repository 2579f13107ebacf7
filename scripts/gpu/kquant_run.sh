#!/usr/bin/env bash
# Issue #18: the CUDA k-quant kernel for Q4_K, Q5_K and Q6_K (kquant_mma.cu) on the H200, in one device call:
#   1. the GPU tests of the kernel (results against dequantize + matmul, batch invariance, rings' bits)
#   2. scripts/gpu/gguf_run.py --skip-kernels on the Q4_K_S-shaped Gemma-4-31B (step times, baseline and DFlash
#      tok/s, same tokens), to set beside docs/performance.md's 12.53 ms decode step; KQ_MODEL_S seconds at most
#   3. scripts/gpu/mma_tilings.py on the Q5_K / Q6_K shapes of Gemma-4-31B Q4_K_S and Qwen3-8B Q4_K_M (direct
#      loads; KQ_SETS, KQ_TILING_S seconds at most), for TILINGS
#     bash scripts/gpu/kquant_run.sh     # logs and JSON to $OUT; carry .whl (device/README.md) for gguf
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1  # gguf (for the tests), from .whl
OUT=${OUT:-/tmp/out}
SETS=${KQ_SETS:-gemma-q6k,gemma-q5k,qwen-q6k}
MODEL_S=${KQ_MODEL_S:-240}
TILING_S=${KQ_TILING_S:-90}
mkdir -p "$OUT"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_mma_kernels.py 2>&1 | tail -6
timeout "$MODEL_S" python scripts/gpu/gguf_run.py "$OUT/model" --skip-kernels --budget-s $(( MODEL_S - 35 )) \
  > "$OUT/gguf_model.log" 2>&1
grep -E "^\(c\) (baseline|steps|DFlash)|peak memory|checks|rror" "$OUT/gguf_model.log" | head -30
timeout $(( TILING_S + 60 )) python scripts/gpu/mma_tilings.py "$OUT" --only "$SETS" --no-rings --budget-s "$TILING_S" \
  > "$OUT/mma_tilings.log" 2>&1
grep -v -i warn "$OUT/mma_tilings.log" | grep -E "best|MmaTiling|budget|rror|}" | head -30
