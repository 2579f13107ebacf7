# session 47, call 1: on an H200 the side by side's first half (#20/#18); on an H100 the merged Q4_K layout's Triton paths checked and the prefill re-measured
START=$(date +%s); left() { echo $(( 575 - ($(date +%s) - START) )); }
step() { local need=$1; shift; local l=$(left); if [ $l -gt $need ]; then timeout $(( l < $need*2 ? l-10 : need*2 )) "$@"; else echo "skip (left $l): $*"; fi; }
nvidia-smi -L
if nvidia-smi -L | grep -q H200; then
  bash scripts/gpu/llama_bench_prebuilt.sh stash
  OUT=$OUT SBS_BUDGET_S=450 SBS_NEED_FD=290 SBS_MODELS="qwen3-8b:bf16 gemma-4-31b:q4_k_s" SBS_TAUS=6 SBS_PREFILL=512 \
    SBS_DFLASH_PROMPT=512,8192,32768 bash scripts/gpu/side_by_side.sh files flashdraft
  ls -la $OUT; exit 0
fi
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py)
W=/tmp/w; mkdir -p $W
step 100 python -m pytest -q tests/test_q4k_columns.py tests/test_mma_kernels.py -k "super_block_major or quant_linear or columns" > $W/tests.log 2>&1; tail -4 $W/tests.log
PYTHONPATH=$PYTHONPATH:tests step 60 python scripts/gpu/q4k_columns_dequant.py 2>&1 | grep -v Warn | tee $W/dequant.log
SBS_MODELS="gemma-4-31b:q4_k_s" SBS_DEPTHS=0 SBS_PREFILL=512 SBS_TAUS=6 SBS_DFLASH_PROMPT=512 SBS_NEED_FD=120 SBS_BUDGET_S=$(( $(left) - 20 )) \
  SBS_WORK=/tmp/sbs OUT=$W/sbs bash scripts/gpu/side_by_side.sh files flashdraft 2>&1 | tee $W/e2e.log | grep -i "tok/s\|error"
step 90 python -m pytest -q tests/test_gguf_gemma4.py::test_gemma4_gguf_target_and_drafter_decode_losslessly > $W/tests2.log 2>&1; tail -3 $W/tests2.log
cp $W/*.log $OUT/; tar czf $OUT/results.tgz -C $W .; ls -la $OUT
