# session 47, call 4: on this card, the read ceiling of Gemma's gate|up bytes and the Q4_K chunks' product with deeper rings
START=$(date +%s); left() { echo $(( 560 - ($(date +%s) - START) )); }
step() { local need=$1; shift; local l=$(left); if [ $l -gt $need ]; then timeout $(( l < $need*2 ? l-10 : need*2 )) "$@"; else echo "skip (left $l): $*"; fi; }
nvidia-smi -L
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py)
W=/tmp/w4; mkdir -p $W
step 200 python scripts/gpu/q4k_layout_probe.py $W/chunks --layout chunks --stages 4,6 --only gemma-q4k-fused,gemma-q4k 2>&1 | grep -v Warn | tee $W/chunks.log
step 90 python scripts/gpu/read_stream_probe.py $W/read --sizes gemma-gate-up 2>&1 | grep -v Warn | tee $W/read.log
cp $W/*.log $OUT/; tar czf $OUT/results.tgz -C $W .; ls -la $OUT
