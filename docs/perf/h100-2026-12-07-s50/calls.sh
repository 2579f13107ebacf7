# Session 50's device calls: four, all on one NVIDIA H100 80GB HBM3 (calls 1-2 on one machine, 3-4 on another).
# Checkout: main (4cde4da) without the demo weights for call 1, the working tree otherwise.
# call 1: call1.sh (carry .ab, llama-bench parts 00-02, the bench folder's files). The A/B ran out of its 270 s
#         after the baseline (call1-ab.log); read_ring.log / .json, ncu_gateup_m1.txt, ncu_down_m1.txt,
#         mma_tilings_qwen.log / .json (stopped after two shapes) came back.
# call 2: the A/B, 98e868d (.ab/base) against main 4cde4da (call2-ab.log, ab_summary.txt, base-1-*.json, new-1-*.json)
export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py) PYTHONUNBUFFERED=1
OUT=$OUT AB_MODELS="gemma-4-31b:q4_k_s" AB_ROUNDS=1 AB_BUDGET_S=560 AB_NEED_S=150 bash scripts/gpu/ab_run.sh
# call 3: call3.sh on addf41f (MmaTiling.l2_ahead, since removed): tests_l2_ahead.log, mma_l2_ahead.log / .json
#         (mma_tilings.py --only gemma-step,qwen-q4k-fused,qwen-q4k-rest --copy-engine --adopted-only --l2-ahead 1,2,4);
#         its Gemma lossless tests ran out of the call's 250 s. (addf41f's mma_tilings.py took --copy-engine beside
#         --adopted-only and ignored it; today's refuses the pair.)
# call 4: the Gemma lossless tests (lossless_test.log: 6 passed in 147 s)
timeout 160 python -m pytest -q -x tests/test_gguf_gemma4.py -k losslessly
