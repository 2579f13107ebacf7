# Session 51's first call (from the repo root on the GPU machine, .ab/base holding 98e868d's src and
# .llamacpp-bench's three files carried): session 50's next_call.sh with the x variants first, "x in shared memory"
# added beside "x a super-block ahead". Everything goes to $OUT/call1.tgz.
START=$(date +%s); left(){ echo $(( 565 - ($(date +%s)-START) )); }
step(){ need=$1; shift; l=$(left); if [ $l -gt $need ]; then timeout -k 10 $(( l < need*2 ? l-15 : need*2 )) "$@"; echo "[rc $? at +$(( $(date +%s)-START ))s] $*"; else echo "skip (left $l): $*"; fi; }
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py) PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $R/gpu.txt; cat $R/gpu.txt
step 60 python scripts/gpu/kquant_ablate.py $R --only gemma-step --variants "x a super-block ahead,x in shared memory" > $R/ablate_x.log 2>&1
cat $R/ablate_x.log
step 40 python scripts/gpu/read_stream_probe.py $R --sizes gemma-gate-up --kinds ring,columns,bulk > $R/read_ring.log 2>&1
step 40 python scripts/gpu/q4k_layout_probe.py $R --layout columns --only gemma-q4k-fused > $R/q4k_columns.log 2>&1
step 40 python scripts/gpu/q4k_layout_probe.py $R --layout chunks --only gemma-q4k-fused > $R/q4k_chunks.log 2>&1
step 30 ncu --clock-control none -k regex:kq_mma --launch-skip 3 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats \
    --section MemoryWorkloadAnalysis --section SourceCounters -o $R/gateup_m1 \
    python scripts/gpu/kquant_ncu.py gemma-step "gate|up" --rows 1 > $R/ncu_run.log 2>&1
step 15 ncu --import $R/gateup_m1.ncu-rep --print-details all > $R/ncu_gateup_m1.txt 2>&1
step 15 ncu --import $R/gateup_m1.ncu-rep --page source --csv --print-source sass > $R/gateup_m1_source.csv 2>&1
AB=$(( $(left) - 5 ))
if [ $AB -ge 330 ]; then
    OUT=$R AB_MODELS="gemma-4-31b:q4_k_s" AB_ROUNDS=1 AB_BUDGET_S=$AB AB_NEED_S=100 bash scripts/gpu/ab_run.sh > /dev/null 2>&1
    echo "ab rc $?"; cp $R/ab_summary.txt $OUT/
else
    echo "no time for the A/B ($AB s; it needs 330)"
fi
tail -3 $R/*.log
tar -czf $OUT/call1.tgz -C $OUT r && rm -rf $R; ls -la $OUT
