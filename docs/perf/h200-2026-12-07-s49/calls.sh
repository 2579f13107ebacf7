# Session 49's device calls, on one NVIDIA H200 (143771 MiB, 1980 MHz), held warm through calls 1-3; the checkout
# was main's code of this session as a light commit (the demo weights dropped). Carried: .ab (these scripts) and the
# bench folder's beellama-src.tar.gz (gguf-py for the tests).
# call 1 (102 s): tests_mma.log, mma_tilings.log / .json (gate|up; the budget let no second shape start)
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py) PYTHONUNBUFFERED=1
timeout 120 python -m pytest -q -x tests/test_mma_kernels.py -k "copy_engine or shared_memory_ring or super_block_major"
python scripts/gpu/mma_tilings.py $W/til --only gemma-step --copy-engine --budget-s 5
# calls 2 and 3 (68 s, 37 s): the same sweep on the set's other shapes (mma_tilings_rest.*: down, sliding q|k|v,
# sliding o; mma_tilings_full.*: full q|k, full o), through a wrapper that left the measured shapes out of
# mma_tilings.SETS["gemma-step"] and called mma_tilings.main() with the same arguments (--budget-s 60 and 30)
