# session 47, call 3 (H200 or H100): the merged Q4_K layout's chunked Triton paths checked; where Gemma's plain step goes on this card
START=$(date +%s); left() { echo $(( 575 - ($(date +%s) - START) )); }
step() { local need=$1; shift; local l=$(left); if [ $l -gt $need ]; then timeout $(( l < $need*2 ? l-10 : need*2 )) "$@"; else echo "skip (left $l): $*"; fi; }
nvidia-smi -L
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py)
W=/tmp/w3; mkdir -p $W
step 100 python -m pytest -q tests/test_q4k_columns.py tests/test_mma_kernels.py -k "super_block_major or quant_linear or columns" > $W/tests.log 2>&1; tail -4 $W/tests.log
PYTHONPATH=$PYTHONPATH:tests step 60 python scripts/gpu/q4k_columns_dequant.py 2>&1 | grep -v Warn | tee $W/dequant.log
step 90 python -m pytest -q tests/test_gguf_gemma4.py::test_gemma4_gguf_target_and_drafter_decode_losslessly > $W/tests2.log 2>&1; tail -3 $W/tests2.log
step 150 python scripts/gpu/gguf_profile.py $W/prof 2>&1 | grep -v Warn | tee $W/profile.log | tail -40
cp $W/*.log $OUT/; tar czf $OUT/results.tgz -C $W .; ls -la $OUT
