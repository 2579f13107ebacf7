#!/usr/bin/env bash
# Issue #18: the CUDA Q4_K kernel with its weights staged through a shared-memory ring (MmaTiling.stages) against
# the direct loads, on the H200, in one device call:
#   1. the GPU tests of the kernel (results, batch invariance, the ring's bits equal the direct loads')
#   2. scripts/gpu/mma_tilings.py: every ring tiling on Gemma-4-31B's Q4_K shapes beside the adopted tilings
#   3. scripts/gpu/gguf_run.py --skip-kernels on the Q4_K_S-shaped Gemma-4-31B with the best tilings of step 2
#      (step times, baseline and DFlash tok/s, same tokens), to set beside docs/performance.md's 12.76 ms step
#     bash scripts/gpu/q4k_ring_run.sh     # logs and JSON to $OUT; carry .whl (device/README.md) for gguf
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1  # gguf (for the tests), from .whl
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pytest -q -p no:cacheprovider tests/test_mma_kernels.py 2>&1 | tail -4
python scripts/gpu/mma_tilings.py "$OUT" > "$OUT/mma_tilings.log" 2>&1
grep -v -i warn "$OUT/mma_tilings.log" | grep -E "best|TILINGS|MmaTiling|Error|}" | head -40
python scripts/gpu/gguf_run.py "$OUT/model" --skip-kernels --mma-tilings "$OUT/mma_tilings.json" \
  > "$OUT/gguf_model.log" 2>&1
grep -E "^\(c\) (baseline|steps|DFlash)|tilings from|peak memory|checks" "$OUT/gguf_model.log"
