# Prepared in session 50 for the next H200 call (not yet run): the one-row measurements that say where the H200's
# 2.6-2.75 TB/s floor comes from (and x's fragments loaded a super-block ahead), then the A/B of session 49's tilings.
# From the repo root on the GPU machine, with .ab/base holding 98e868d's src (git archive 98e868d src | tar -x -C
# .ab/base; demo weights deleted) and .llamacpp-bench's beellama-src.tar.gz, make_gguf.py and device_cmd.sh:
#   bash docs/perf/h100-2026-12-07-s50/next_call.sh
# Everything is written to $OUT/next_call.tgz, and ab_summary.txt beside it.
START=$(date +%s); left(){ echo $(( 565 - ($(date +%s)-START) )); }
step(){ need=$1; shift; l=$(left); if [ $l -gt $need ]; then timeout -k 10 $(( l < need*2 ? l-15 : need*2 )) "$@"; echo "[rc $? at +$(( $(date +%s)-START ))s] $*"; else echo "skip (left $l): $*"; fi; }
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py) PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $R/gpu.txt; cat $R/gpu.txt
step 40 python scripts/gpu/read_stream_probe.py $R --sizes gemma-gate-up --kinds ring,columns,bulk > $R/read_ring.log 2>&1
step 40 python scripts/gpu/q4k_layout_probe.py $R --layout columns --only gemma-q4k-fused > $R/q4k_columns.log 2>&1
step 40 python scripts/gpu/q4k_layout_probe.py $R --layout chunks --only gemma-q4k-fused > $R/q4k_chunks.log 2>&1
step 40 python scripts/gpu/kquant_ablate.py $R --only gemma-step --variants "x a super-block ahead" > $R/ablate_x_ahead.log 2>&1
# one profile of the one-row gate|up: its sections, and its stall samples per SASS instruction (which loads the long
# scoreboard waits on)
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
tar -czf $OUT/next_call.tgz -C $OUT r && rm -rf $R; ls -la $OUT
