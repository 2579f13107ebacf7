# session 47's device calls on one H200 (the machine stayed warm from call 1 to call 7, so /tmp/sbs-work, with
# call 1's flashdraft results and call 2's unpacked llama-bench, was the same for calls 1, 2 and 6)
# call 1: call1.sh (its H200 branch: the files and flashdraft's half; carried .ab and prebuilt parts 00-02)
# call 2 (carried prebuilt parts 03-04, prebuilt.sha256 and the bench folder's files):
bash scripts/gpu/llama_bench_prebuilt.sh unpack && OUT=$OUT SBS_BUDGET_S=540 SBS_NEED_FD=290 \
  SBS_MODELS="qwen3-8b:bf16 gemma-4-31b:q4_k_s" SBS_TAUS=6 SBS_PREFILL=512 SBS_DFLASH_PROMPT=512,8192,32768 \
  bash scripts/gpu/side_by_side.sh files flashdraft llama table
# call 3: call3.sh; call 4: call4.sh
# call 5:
PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py) python scripts/gpu/kquant_ablate.py $OUT/ablate \
  --only gemma-q4k-fused,gemma-q4k --budget-s 300
# call 6 (the same llama-bench build and work folder as call 2):
OUT=$OUT SBS_BUDGET_S=500 SBS_NEED_FD=200 SBS_MODELS="qwen3-8b:q4_k_m" SBS_TAUS=6 SBS_PREFILL=512 \
  SBS_DFLASH_PROMPT=512,8192,32768 bash scripts/gpu/side_by_side.sh files flashdraft llama table
# call 7:
PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py) python scripts/gpu/kquant_waves.py $OUT/waves \
  --only gemma-gate-up,gemma-down,gemma-gate-up-direct
