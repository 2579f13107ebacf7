# Session 48's device calls, all on one NVIDIA H100 80GB HBM3 (the H200 was refused twice; the machine stayed
# warm through calls 1-5). Checkout: branch next/s48 as a light commit (the demo weights dropped).
# call 1: call1.sh (carry .ab). Its MMA tests did not run (gguf-py not carried: an import error); the norm tests,
#         ring_fill_run.py (ring_fill.log / .json) and read_stream_probe.py --kinds ring,columns,bulk
#         (read_ring.log) did.
# call 2 (carry .ab and the bench folder's beellama-src.tar.gz, make_gguf.py, device_cmd.sh):
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py)
timeout 110 python -m pytest -q -x tests/test_mma_kernels.py -k "bulk or x_in_the_ring or shared_memory_ring or super_block_major" > $OUT/tests_mma.log 2>&1   # call2-tests_mma.log
OUT=$OUT AB_MODELS="gemma-4-31b:q4_k_s" AB_ROUNDS=2 AB_BUDGET_S=440 AB_TESTS="tests/test_gguf_gemma4.py -k losslessly" bash scripts/gpu/ab_run.sh   # call2-ab.log: the tests ran out of ab_run's time (5 of 6 passed), base measured once
# call 3: the A/B, main (ca63940, .ab/base) against the branch (call3-ab.log, ab_summary.txt, base-1-*.json, new-1-*.json)
OUT=$OUT AB_MODELS="gemma-4-31b:q4_k_s" AB_ROUNDS=1 AB_BUDGET_S=520 AB_NEED_S=120 bash scripts/gpu/ab_run.sh
# call 4: the Gemma lossless tests (6 passed in 114 s) and batch invariance (gemma4_invariance.json, gemma4_moe_invariance.json)
timeout 250 python -m pytest -q tests/test_gguf_gemma4.py -k losslessly
timeout 150 python scripts/gpu/gemma4_invariance.py $OUT; timeout 120 python scripts/gpu/gemma4_invariance.py $OUT --moe
# call 5 (call 4's mistake: the file's folder is /tmp/sbs-gguf): peak memory at 8K (memory_fit.json)
timeout 270 python scripts/gpu/memory_fit.py /tmp/sbs-gguf/gemma-4-31b__q4_k_s.gguf $OUT --context 8192
