#!/usr/bin/env bash
# The server's slots on the embedded demo pair (CPU): `flashdraft serve -np NP` from SRC_DIR, then the bench's
# client at NP concurrent streams (baseline and DFlash) and at one, 128 tokens each. Run it for two checkouts in
# turn to compare them (issue #23's batched step and its cost model: docs/performance.md).
#
# Usage: [NP=4] [PROMPTS=code] bash scripts/cpu/batched_step_bench.sh SRC_DIR PORT OUT_PREFIX
#   writes OUT_PREFIX.server.log, OUT_PREFIX-concurrencyNP.txt (NP streams), OUT_PREFIX-one-stream.txt
set -u
SRC=$1 PORT=$2 OUT=$3
NP=${NP:-4} PROMPTS=${PROMPTS:-code}
PYTHONPATH=$SRC python -m flashdraft.cli serve -np "$NP" --port "$PORT" > "$OUT.server.log" 2>&1 &
PID=$!
for _ in $(seq 1 120); do curl -s "localhost:$PORT/health" | grep -q ok && break; sleep 1; done
PYTHONPATH=$SRC python -m flashdraft.cli bench --url "http://127.0.0.1:$PORT" --concurrency "$NP" -n 128 --reps 1 \
    --prompts "$PROMPTS" > "$OUT-concurrency$NP.txt" 2>&1
PYTHONPATH=$SRC python -m flashdraft.cli bench --url "http://127.0.0.1:$PORT" -n 128 --reps 1 --prompts "$PROMPTS" \
    > "$OUT-one-stream.txt" 2>&1
kill $PID
wait $PID 2>/dev/null
