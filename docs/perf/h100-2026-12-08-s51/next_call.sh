# Prepared in session 51 for the next call (not yet run; the device time went on starts that found no machine):
# the ways of bringing x to the one-row loop sooner, with each build's registers and blocks a multiprocessor
# (kquant_ablate.py prints them), then, if one of those that keep the bits and serve every M gains 1% or more over
# Gemma's step at one row (its shapes weighted by how often a step runs them), main against main with it in the
# kernel, end to end (ab_run.sh; DFlash checks the tokens). From the repo root on the GPU machine, carrying
# .llamacpp-bench's beellama-src.tar.gz, make_gguf.py and device_cmd.sh:
#   bash docs/perf/h100-2026-12-08-s51/next_call.sh
# Everything goes to $OUT/next_call.tgz.
START=$(date +%s); left(){ echo $(( 575 - ($(date +%s)-START) )); }
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $R/gpu.txt; cat $R/gpu.txt
timeout 200 python scripts/gpu/kquant_ablate.py $R --only gemma-step --variants \
    "x into L1 1 ahead,x into L1 2 ahead,x in the copy engine's ring,x loaded once,x in shared memory" \
    > $R/ablate_x.log 2>&1
echo "ablate rc $?"; cat $R/ablate_x.log
BEST=$(python - $R/kquant_ablate.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
# a step's one-row product time: each shape as often as Gemma-4-31B runs it (60 gate|up and down, 50 sliding
# q|k|v and o, 10 full q|k and o; mma_tilings.SETS's note)
times = {"gate|up": 60, "down": 60, "sliding q|k|v": 50, "sliding o": 50, "full q|k": 10, "full o": 10}
total = {}
for r in rows:
    total[r["variant"]] = total.get(r["variant"], 0) + times[r["shape"]] * r["us_m1"]
base = total.get("as is", 0)
# those that keep the bits and can serve every M ("x in shared memory" holds one row only)
candidates = [v for v in total if (v.startswith("x into L1") or v == "x in the copy engine's ring")
              and all(r["same_bits"] for r in rows if r["variant"] == v)]
best = min(candidates, key=total.get, default=None)
print(best if best and total[best] < 0.99 * base else "")
PY
)
echo "best: '$BEST' (left $(left) s)"
if [ -n "$BEST" ] && [ $(left) -ge 330 ]; then
    mkdir -p /tmp/abbase && cp -r src /tmp/abbase/
    python - "$BEST" <<'PY'
import sys
sys.path.insert(0, "scripts/gpu")
import kquant_ablate as ka
from flashdraft.quant import mma_kernels
mma_kernels.SOURCE.write_text(ka.variant_source(sys.argv[1], mma_kernels.SOURCE.read_text()))
PY
    export PYTHONPATH=src:$(bash scripts/gpu/side_by_side.sh --print-gguf-py)
    OUT=$R AB_BASE=/tmp/abbase/src AB_MODELS="gemma-4-31b:q4_k_s" AB_ROUNDS=1 AB_BUDGET_S=$(( $(left) - 5 )) \
        AB_NEED_S=100 bash scripts/gpu/ab_run.sh > /dev/null 2>&1
    echo "ab rc $?"; cat $R/ab_summary.txt
fi
tar -czf $OUT/next_call.tgz -C $OUT r && rm -rf $R
