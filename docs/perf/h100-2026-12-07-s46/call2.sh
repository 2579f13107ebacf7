# session 46, call 2: Gemma-4-31B Q4_K_S end to end, main against the Q4_K columns branch (flashdraft only, same file, same machine)
export SBS_MODELS="gemma-4-31b:q4_k_s" SBS_DEPTHS=0 SBS_PREFILL=512 SBS_TAUS=6 SBS_DFLASH_PROMPT=512 SBS_KEEP_GGUF=1 SBS_NEED_FD=150
nvidia-smi -L
SBS_WORK=/tmp/sbs-main SBS_BUDGET_S=290 OUT=/tmp/o-main bash scripts/gpu/side_by_side.sh files flashdraft > /tmp/main.log 2>&1; echo "main rc $?"
grep -i "tok/s\|error" /tmp/main.log | tail -12
patch -p1 -s < .ab/q4k.patch && echo patched
SBS_WORK=/tmp/sbs-cols SBS_BUDGET_S=260 OUT=/tmp/o-cols bash scripts/gpu/side_by_side.sh flashdraft > /tmp/cols.log 2>&1; echo "cols rc $?"
grep -i "tok/s\|error" /tmp/cols.log | tail -12
cp /tmp/main.log /tmp/cols.log $OUT/; tar czf $OUT/sbs.tgz /tmp/o-main /tmp/o-cols /tmp/sbs-main/results /tmp/sbs-cols/results 2>/dev/null; ls -la $OUT
