# Session 51's third call, with the device time left after refused starts: call2.sh's ablation alone (the ways of
# bringing x to the one-row loop sooner, each build's registers and blocks a multiprocessor). $OUT/call3.tgz.
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $R/gpu.txt; cat $R/gpu.txt
timeout 150 python scripts/gpu/kquant_ablate.py $R --only gemma-step \
    --variants "x into L1 1 ahead,x into L1 2 ahead,x in shared memory" > $R/ablate_x.log 2>&1
echo "ablate rc $?"; cat $R/ablate_x.log
tar -czf $OUT/call3.tgz -C $OUT r && rm -rf $R
