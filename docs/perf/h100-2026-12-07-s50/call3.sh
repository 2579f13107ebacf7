# session 50, call 3: the L2 prefetch of direct loads (MmaTiling.l2_ahead): its bits on the GPU, and the adopted
# tilings with and without it on Gemma's step and Qwen3-8B's Q4_K shapes; on an H200 also the A/B (98e868d vs this
# tree's kernel without l2_ahead adopted = main's tilings) and ncu of the one-row gate|up; the Gemma lossless tests last
START=$(date +%s); left(){ echo $(( 250 - ($(date +%s)-START) )); }
step(){ need=$1; shift; l=$(left); if [ $l -gt $need ]; then timeout $(( l < need*2 ? l-5 : need*2 )) "$@"; echo "[rc $? at +$(( $(date +%s)-START ))s] $*"; else echo "skip (left $l): $*"; fi; }
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py) PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $R/gpu.txt; cat $R/gpu.txt
step 30 python -m pytest -q tests/test_mma_kernels.py -k "l2_prefetch or copy_engine" > $R/tests_l2.log 2>&1; tail -1 $R/tests_l2.log
step 60 python scripts/gpu/mma_tilings.py $R --only gemma-step,qwen-q4k-fused,qwen-q4k-rest --copy-engine --adopted-only --l2-ahead 1,2,4 > $R/mma_l2.log 2>&1
grep -v '^ ' $R/mma_l2.log | grep 'best\|MmaTiling' | head -30
NCU="ncu --clock-control none -k regex:kq_mma --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis --section SourceCounters --print-details all"
if grep -q H200 $R/gpu.txt; then
  step 20 $NCU python scripts/gpu/kquant_ncu.py gemma-step "gate|up" --rows 1 > $R/ncu_gateup_m1.txt 2>&1
  AB_BUDGET_S=$(( $(left) - 5 )); [ $AB_BUDGET_S -gt 230 ] && OUT=$R AB_MODELS="gemma-4-31b:q4_k_s" AB_ROUNDS=1 AB_BUDGET_S=$AB_BUDGET_S AB_NEED_S=100 bash scripts/gpu/ab_run.sh > /dev/null 2>&1; echo "ab rc $? at +$(( $(date +%s)-START ))s"
  cat $R/ab_summary.txt
fi
step 100 python -m pytest -q tests/test_gguf_gemma4.py -k losslessly > $R/lossless_test.log 2>&1; tail -1 $R/lossless_test.log
tar -czf $OUT/call4.tgz -C $OUT r && rm -rf $R; ls -la $OUT
