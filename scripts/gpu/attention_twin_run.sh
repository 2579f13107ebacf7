#!/usr/bin/env bash
# Issue #20: the whole-block attention tile's 16-row twin (decode_attention.ROW_TWINS) on the GPU, in one device call:
#   1. the GPU tests of the decode attention that check bits: the twin against the 64-row tile (a 16-token pass
#      against each token alone), rows independent of the block and of the graph bucket, segmented launches, and
#      the sm_90 machine-code budget (two programs a multiprocessor, no spills)
#   2. scripts/gpu/attention_run.py --long: the long-cache tilings and the twins' bits, us a layer at 512 / 8K / 32K
#   3. scripts/gpu/profile_step.py --generate --context 32768: Qwen3-8B's plain and DFlash steps after 32K tokens,
#      kernel by kernel (calls, us a call)
#     OUT=... bash scripts/gpu/attention_twin_run.sh [tests] [tilings] [profile]   # default: all three
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
STAGES=${*:-tests tilings profile}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
git log -1 --format="commit %H" >> "$OUT/gpu.txt" 2>/dev/null
for stage in $STAGES; do
  case $stage in
    tests)
      timeout 240 python -m pytest -q -p no:cacheprovider tests/test_decode_attention.py tests/test_kernel_machine_code.py \
        -k "twin or long_caches or independent or bucket or several_caches or fit_two" > "$OUT/gpu_tests.log" 2>&1
      tail -4 "$OUT/gpu_tests.log" ;;
    tilings)
      timeout 300 python scripts/gpu/attention_run.py "$OUT/attention" --long > "$OUT/attention_long.log" 2>&1
      grep -v -i warn "$OUT/attention_long.log" | tail -12 ;;
    profile)
      timeout 300 python scripts/gpu/profile_step.py qwen3-8b --generate --context 32768 > "$OUT/profile_32k.log" 2>&1
      grep -v -i warn "$OUT/profile_32k.log" | tail -70 ;;
  esac
done
