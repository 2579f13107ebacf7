# Session 51's second call: the ways of bringing x to the one-row loop sooner, with each build's registers and
# blocks a multiprocessor (kquant_ablate.py prints them now). Everything goes to $OUT/call2.tgz.
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $R/gpu.txt; cat $R/gpu.txt
timeout 300 python scripts/gpu/kquant_ablate.py $R --only gemma-step \
    --variants "x into L1 1 ahead,x into L1 2 ahead,x loaded once,x a super-block ahead,x in shared memory" \
    > $R/ablate_x.log 2>&1; echo "rc $?"
cat $R/ablate_x.log
tar -czf $OUT/call2.tgz -C $OUT r && rm -rf $R
