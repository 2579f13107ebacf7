# session 48, call 1 (either card; checkout: branch next/s48 as device-lite; carry .ab)
START=$(date +%s); left() { echo $(( 575 - ($(date +%s) - START) )); }
step() { local need=$1; shift; local l=$(left); if [ $l -gt $need ]; then timeout $(( l < $need*2 ? l-10 : need*2 )) "$@"; else echo "skip (left $l): $*"; fi; }
nvidia-smi -L
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py)
W=/tmp/w; mkdir -p $W
step 120 python -m pytest -q -x tests/test_mma_kernels.py -k "bulk or x_in_the_ring or shared_memory_ring or batch_invariant or super_block_major" > $W/tests_mma.log 2>&1; tail -5 $W/tests_mma.log
step 60 python -m pytest -q tests/test_rms_norm_rows.py tests/test_decode_attention.py -k "gemma" > $W/tests_norms.log 2>&1; tail -3 $W/tests_norms.log
step 150 python scripts/gpu/ring_fill_run.py $W/fill --only gemma-q4k-fused,gemma-q4k,qwen-q4k-fused,qwen-q4k-rest 2>&1 | grep -v Warn | tee $W/ring_fill.log
step 60 python scripts/gpu/read_stream_probe.py $W/read --sizes gemma-gate-up --kinds ring,columns,bulk 2>&1 | grep -v Warn | tee $W/read_ring.log
cp $W/*.log $OUT/; cp $W/fill/*.json $OUT/ 2>/dev/null; tar czf $OUT/results.tgz -C $W .; ls -la $OUT
