# session 46, call 1: on an H200 the side by side's first half (#20/#18); on an H100 main's row-kernel checks, then the Q4_K columns branch (as a patch)
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
step 100 python -m pytest -q tests/test_decode_attention.py tests/test_expert_kernels.py -k "gemma4 or compiled" > $W/tests.log 2>&1; tail -6 $W/tests.log
step 60 python scripts/gpu/gemma4_invariance.py $W/dense > $W/inv.log 2>&1; grep -v Warn $W/inv.log | tail -6
step 80 python scripts/gpu/gemma4_invariance.py $W/moe --moe >> $W/inv.log 2>&1; grep -v Warn $W/inv.log | tail -6
step 50 python scripts/gpu/expert_pairs_run.py $W > $W/pairs.log 2>&1; head -8 $W/pairs.log
patch -p1 -s < .ab/q4k.patch && echo patched
step 100 python -m pytest -q tests/test_q4k_columns.py tests/test_mma_kernels.py -k "super_block_major or quant_linear or split_k or residual or columns" > $W/branch_tests.log 2>&1; tail -6 $W/branch_tests.log
step 40 python scripts/gpu/q4k_layout_probe.py $W/chunks --layout chunks --only gemma-q4k-fused,qwen-q4k-fused > $W/probe.log 2>&1; tail -8 $W/probe.log
step 40 python scripts/gpu/q4k_layout_probe.py $W/columns --layout columns --only gemma-q4k-fused,qwen-q4k-fused >> $W/probe.log 2>&1; tail -8 $W/probe.log
step 90 python -m pytest -q tests/test_gguf_gemma4.py::test_gemma4_gguf_target_and_drafter_decode_losslessly > $W/branch_tests2.log 2>&1; tail -4 $W/branch_tests2.log
cp $W/*.log $OUT/; tar czf $OUT/results.tgz -C $W .; ls -la $OUT
