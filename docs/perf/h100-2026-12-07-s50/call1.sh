# session 50, call 1: stash llama-bench parts 00-02; the A/B (98e868d vs main) on Gemma-4-31B Q4_K_S; the ring
# alone and the read alone on gate|up; ncu of the one-row gate|up and down products; Qwen's tilings with what is left
START=$(date +%s); left(){ echo $(( 565 - ($(date +%s)-START) )); }
step(){ need=$1; shift; l=$(left); if [ $l -gt $need ]; then timeout $(( l < need*2 ? l-5 : need*2 )) "$@"; echo "[rc $? at +$(( $(date +%s)-START ))s] $*"; else echo "skip (left $l): $*"; fi; }
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py) PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $R/gpu.txt
bash scripts/gpu/llama_bench_prebuilt.sh stash > $R/stash.log 2>&1; echo "stash rc $?"
OUT=$R AB_MODELS="gemma-4-31b:q4_k_s" AB_ROUNDS=1 AB_BUDGET_S=270 AB_NEED_S=100 bash scripts/gpu/ab_run.sh > /dev/null 2>&1; echo "ab rc $? at +$(( $(date +%s)-START ))s"
cp $R/ab_summary.txt $OUT/ 2>/dev/null
step 40 python scripts/gpu/read_stream_probe.py $R --sizes gemma-gate-up --kinds ring,columns,bulk > $R/read_ring.log 2>&1
NCU="ncu --clock-control none -k regex:kq_mma --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis --section SourceCounters --print-details all"
step 40 $NCU python scripts/gpu/kquant_ncu.py gemma-step "gate|up" --rows 1 > $R/ncu_gateup_m1.txt 2>&1
step 40 $NCU python scripts/gpu/kquant_ncu.py gemma-step "down" --rows 1 > $R/ncu_down_m1.txt 2>&1
step 40 python scripts/gpu/mma_tilings.py $R --only qwen-q4k-fused,qwen-q4k-rest --copy-engine --budget-s $(( $(left) - 60 )) > $R/mma_tilings_qwen.log 2>&1
tar -czf $OUT/call1.tgz -C $OUT r && rm -rf $R; ls -la $OUT
