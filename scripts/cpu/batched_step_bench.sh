#!/usr/bin/env bash
# The server's four slots on the embedded demo pair (CPU): `flashdraft serve -np 4` from SRC_DIR, then the bench's
# client at four concurrent streams (12 requests a way, baseline and DFlash) and at one, 128 tokens each. Run it for
# two checkouts in turn to compare them (issue #23's batched step: docs/performance.md).
#
# Usage: bash scripts/cpu/batched_step_bench.sh SRC_DIR PORT OUT_PREFIX
#   writes OUT_PREFIX.server.log, OUT_PREFIX.c4.txt (4 streams), OUT_PREFIX.c1.txt (one stream)
set -u
SRC=$1 PORT=$2 OUT=$3
PYTHONPATH=$SRC python -m flashdraft.cli serve -np 4 --port "$PORT" > "$OUT.server.log" 2>&1 &
PID=$!
for _ in $(seq 1 120); do curl -s "localhost:$PORT/health" | grep -q ok && break; sleep 1; done
PYTHONPATH=$SRC python -m flashdraft.cli bench --url "http://127.0.0.1:$PORT" --concurrency 4 -n 128 --reps 1 \
    > "$OUT.c4.txt" 2>&1
PYTHONPATH=$SRC python -m flashdraft.cli bench --url "http://127.0.0.1:$PORT" -n 128 --reps 1 > "$OUT.c1.txt" 2>&1
kill $PID
wait $PID 2>/dev/null
