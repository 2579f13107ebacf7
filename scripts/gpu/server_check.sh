#!/usr/bin/env bash
# Issue #24's server check: the walkthrough's client (three code prompts, T 0.7 / top-k 64 / top-p 0.95) against
# `flashdraft serve` with the walkthrough's flags on the embedded demo pair, with the drafter and without
# (--spec-type none); `flashdraft bench --url` (streamed: time to first token, tok/s) against each; and the same
# prompts and sampling in process, for the server-vs-engine ratio. One device call (carry .whl: fastapi, uvicorn,
# starlette, pydantic and what they need; device/README.md):
#     bash scripts/gpu/server_check.sh            # N=300 tokens a reply, CTX=32768
#     N=32 CTX=2048 bash scripts/gpu/server_check.sh   # a quick run, also on a CPU
# Logs and JSON go to $OUT.
set -u
if ! python -c "import fastapi, uvicorn" 2> /dev/null && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=src:/tmp/site
else
  export PYTHONPATH=src
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
N=${N:-300}
CTX=${CTX:-32768}
PORT=${PORT:-8093}
mkdir -p "$OUT"
SAMPLING="--temp 0.7 --top-k 64 --top-p 0.95 --min-p 0.0"
URL="http://127.0.0.1:$PORT"
for spec in dflash none; do
  started=$SECONDS
  python -m flashdraft.cli serve --spec-type $spec -c "$CTX" $SAMPLING --port "$PORT" > "$OUT/serve_$spec.log" 2>&1 &
  pid=$!
  until python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$URL/health" \
      2> /dev/null; do
    if ! kill -0 $pid 2> /dev/null; then echo "serve ($spec) exited" >&2; tail -20 "$OUT/serve_$spec.log" >&2; exit 1; fi
    sleep 0.5
  done
  echo "$spec: ready (loaded and warmed up) after $((SECONDS - started)) s" | tee "$OUT/client_$spec.txt"
  python scripts/walkthrough/client.py --url "$URL" --max-tokens "$N" | tee -a "$OUT/client_$spec.txt"
  python -m flashdraft.cli bench --url "$URL" --prompts code $SAMPLING -n "$N" --reps 2 --json \
    > "$OUT/bench_url_$spec.json" 2> "$OUT/bench_url_$spec.log"
  tail -8 "$OUT/bench_url_$spec.log"
  kill $pid; wait $pid 2> /dev/null
done
python -m flashdraft.cli bench --prompts code $SAMPLING -n "$N" --reps 2 -c "$CTX" --json > "$OUT/bench_inprocess.json" \
  2> "$OUT/bench_inprocess.log"
tail -8 "$OUT/bench_inprocess.log"
