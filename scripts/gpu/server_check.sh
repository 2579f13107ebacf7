#!/usr/bin/env bash
# The server checks of issues #24 and #21, one device call per phase (carry .whl: fastapi, uvicorn, starlette,
# pydantic and what they need, device/README.md; and for `synthetic`, .llamacpp-bench/: a copy of the llamacpp-bench
# folder, for make_gguf.py):
#   demo (default)  the walkthrough's client (three code prompts, T 0.7 / top-k 64 / top-p 0.95) against
#                   `flashdraft serve` with the walkthrough's flags on the embedded demo pair, with the drafter and
#                   without (--spec-type none); `flashdraft bench --url` (streamed: time to first token, tok/s)
#                   against each; the same prompts and sampling in process, for the server-vs-engine ratio; time to
#                   first token for new prompts of 100 and more tokens from the first request on
#                   (scripts/gpu/ttft_check.py), through the server and in process; n-gram drafting in process on
#                   the agent prompts (#21)
#   ttft            the demo phase's time-to-first-token checks alone (through the server with the drafter and
#                   without, then in process), for a short call
#   synthetic       a Qwen3-8B-shaped bf16 GGUF (random weights, written by make_gguf.py) served with -c 32768: the
#                   same first-token check through the server and in process, and a 5-turn conversation of 6000 new
#                   tokens a turn (30K tokens by the last) with its cold prefill (#21); prompts of 8K and 30K
#                   tokens in process, in -ub's default passes and in one pass each
#     bash scripts/gpu/server_check.sh demo            # N=300 tokens a reply, CTX=32768
#     N=32 CTX=2048 bash scripts/gpu/server_check.sh demo   # a quick run, also on a CPU
#     SYNTH_SHAPE=tiny-qwen3 SYNTH_VOCAB=512 TURN_TOKENS=300 LONG=1000,2000 \
#       bash scripts/gpu/server_check.sh synthetic   # a quick run, also on a CPU
# Logs and JSON go to $OUT.
set -u
if ! python -c "import fastapi, uvicorn" 2> /dev/null && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=src:/tmp/site
else
  export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}  # keep where fastapi was found
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
N=${N:-300}
CTX=${CTX:-32768}
PORT=${PORT:-8093}
PHASE=${1:-demo}
TURN_TOKENS=${TURN_TOKENS:-6000}
LONG=${LONG:-8192,30000}  # long prompts in process (synthetic): in passes (-ub's default) and in one pass each
SYNTH_SHAPE=${SYNTH_SHAPE:-qwen3-8b}
SYNTH_VOCAB=${SYNTH_VOCAB:-151936}  # the file's vocabulary (make_gguf.py sizes it to the embedding)
LENGTHS=${LENGTHS:-100,100,100,37,250,512}
ONE_PASS=${ONE_PASS:-1}  # synthetic: 0 leaves out the long prompts in one pass (a warm-up of about 100 s)
mkdir -p "$OUT"
SAMPLING="--temp 0.7 --top-k 64 --top-p 0.95 --min-p 0.0"
URL="http://127.0.0.1:$PORT"
serve() {  # serve NAME ARGS...: start `flashdraft serve ARGS` and wait until it answers /health
  local name=$1; shift
  started=$SECONDS
  python -m flashdraft.cli serve "$@" --port "$PORT" > "$OUT/serve_$name.log" 2>&1 &
  pid=$!
  until python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$URL/health" \
      2> /dev/null; do
    if ! kill -0 $pid 2> /dev/null; then echo "serve ($name) exited" >&2; tail -20 "$OUT/serve_$name.log" >&2; exit 1; fi
    sleep 0.5
  done
  echo "$name: ready (loaded and warmed up) after $((SECONDS - started)) s" | tee "$OUT/client_$name.txt"
}
ttft_demo() {  # ttft_demo SPEC SEED: time to first token through a served demo pair (serve first)
  echo "time to first token, new prompts (through the server):" | tee -a "$OUT/client_$1.txt"
  python scripts/gpu/ttft_check.py --url "$URL" --lengths "$LENGTHS" --seed "$2" \
    --json "$OUT/ttft_server_$1.json" | tee -a "$OUT/client_$1.txt"
}
ttft_in_process() {  # the same prompts in process, with the drafter and without
  local demo=src/flashdraft/demo spec drafter
  for spec in dflash none; do
    echo "time to first token, new prompts (in process, $spec):"
    drafter=(); [ $spec = dflash ] && drafter=(--drafter $demo/drafter)
    python scripts/gpu/ttft_check.py --model $demo/target "${drafter[@]}" -c "$CTX" --lengths "$LENGTHS" --seed 9 \
      --json "$OUT/ttft_inprocess_$spec.json" 2>&1 | tee "$OUT/ttft_inprocess_$spec.txt"
  done
}
serve_demo_each() {  # serve_demo_each FN: the demo pair served with the drafter, then without; FN SPEC SEED on each
  local seed=0 spec
  for spec in dflash none; do
    serve $spec --spec-type $spec -c "$CTX" $SAMPLING
    seed=$((seed + 1))
    "$1" $spec $seed
    kill $pid; wait $pid 2> /dev/null
  done
}
demo_clients() {  # demo_clients SPEC SEED: first tokens, the walkthrough's client and bench --url on a served pair
  ttft_demo "$1" "$2"
  python scripts/walkthrough/client.py --url "$URL" --max-tokens "$N" | tee -a "$OUT/client_$1.txt"
  python -m flashdraft.cli bench --url "$URL" --prompts code $SAMPLING -n "$N" --reps 2 --json \
    > "$OUT/bench_url_$1.json" 2> "$OUT/bench_url_$1.log"
  tail -8 "$OUT/bench_url_$1.log"
}
case "$PHASE" in
  ttft)
    serve_demo_each ttft_demo
    ttft_in_process
    ;;
  demo)
    serve_demo_each demo_clients
    python -m flashdraft.cli bench --prompts code $SAMPLING -n "$N" --reps 2 -c "$CTX" --json \
      > "$OUT/bench_inprocess.json" 2> "$OUT/bench_inprocess.log"
    tail -8 "$OUT/bench_inprocess.log"
    ttft_in_process
    for spec in ngram dflash+ngram; do
      python -m flashdraft.cli bench --spec-type $spec --prompts agent -n 128 --reps 2 -c "$CTX" --json \
        > "$OUT/bench_agent_$spec.json" 2> "$OUT/bench_agent_$spec.log"
      tail -6 "$OUT/bench_agent_$spec.log"
    done
    ;;
  synthetic)
    file=/tmp/$SYNTH_SHAPE-bf16.gguf
    python .llamacpp-bench/make_gguf.py --shape "$SYNTH_SHAPE" --type bf16 -o "$file" | tail -1 || exit 1
    serve synthetic -m "$file" --spec-type none -c 32768
    echo "time to first token, new prompts ($SYNTH_SHAPE bf16 GGUF, through the server):" | tee -a "$OUT/client_synthetic.txt"
    python scripts/gpu/ttft_check.py --url "$URL" --lengths "$LENGTHS" --vocab "$SYNTH_VOCAB" --seed 11 \
      --json "$OUT/ttft_server_synthetic.json" | tee -a "$OUT/client_synthetic.txt"
    echo "a 5-turn conversation, $TURN_TOKENS new tokens a turn, then its cold prefill:" | tee -a "$OUT/client_synthetic.txt"
    python scripts/gpu/ttft_check.py --url "$URL" --turns 5 --turn-tokens "$TURN_TOKENS" --reply-tokens 64 \
      --vocab "$SYNTH_VOCAB" --seed 13 --json "$OUT/turns_synthetic.json" | tee -a "$OUT/client_synthetic.txt"
    kill $pid; wait $pid 2> /dev/null
    echo "time to first token, new prompts ($SYNTH_SHAPE bf16 GGUF, in process):"
    python scripts/gpu/ttft_check.py --model "$file" -c 32768 --lengths "$LENGTHS,$LONG" --seed 12 \
      --json "$OUT/ttft_inprocess_synthetic.json" 2>&1 | tee "$OUT/ttft_inprocess_synthetic.txt"
    if [ "$ONE_PASS" = 1 ]; then
      echo "the long prompts in one pass each (-ub 32768), against the default passes above:"
      python scripts/gpu/ttft_check.py --model "$file" -c 32768 -ub 32768 --lengths "$LONG" --seed 14 \
        --json "$OUT/ttft_inprocess_synthetic_one_pass.json" 2>&1 | tee "$OUT/ttft_inprocess_synthetic_one_pass.txt"
    fi
    rm -f "$file"
    ;;
  *) echo "usage: $0 demo|ttft|synthetic" >&2; exit 2 ;;
esac
