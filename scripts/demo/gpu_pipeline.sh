#!/usr/bin/env bash
# Build the embedded demo pair on one GPU in under 10 minutes:
#   corpus -> tokenizer -> target -> prompts -> responses + drafter (flashdraft train-drafter) -> evaluate -> package
#
# usage: scripts/demo/gpu_pipeline.sh OUT_DIR [WORK_DIR]
#   OUT_DIR  gets target/ and drafter/ (bf16 safetensors: copy them to src/flashdraft/demo/), report.md
#            (the model card's numbers and samples), eval/ and logs/ (pipeline.log, timings.tsv, stage logs).
#   WORK_DIR holds the large intermediates (corpus, token streams, response cache); default /tmp/flashdraft-demo-work.
# Every stage runs under a wall-clock cap (seconds, overridable through the *_CAP variables below); the target
# and drafter stages also size their training to a time budget. Needs torch with CUDA, transformers and
# tokenizers; the package itself comes from src/ (PYTHONPATH), so nothing is installed.
set -euo pipefail

OUT=$(realpath -m "${1:?usage: gpu_pipeline.sh OUT_DIR [WORK_DIR]}")
RUN=$(realpath -m "${2:-${TMPDIR:-/tmp}/flashdraft-demo-work}")
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
SEED=${SEED:-0}
WORKERS=${WORKERS:-$(nproc)}

# Sizes and budgets (the whole run is designed for about 9 minutes on one H200).
TOTAL_SECONDS=${TOTAL_SECONDS:-570}  # the training budgets shrink if earlier stages ran slow
CORPUS_MB=${CORPUS_MB:-160}          # train split of .py files
BPE_SAMPLE_MB=${BPE_SAMPLE_MB:-24}   # text the BPE is trained on
VOCAB=${VOCAB:-8192}
TARGET_SECONDS=${TARGET_SECONDS:-170}     # target training time (at most)
AFTER_TARGET=${AFTER_TARGET:-310}         # seconds kept for the stages after the target
DRAFT_PROMPTS=${DRAFT_PROMPTS:-40000}     # prompts offered; the generation budget decides how many get a response
GEN_SECONDS=${GEN_SECONDS:-60}            # response generation time (at most)
AFTER_GENERATION=${AFTER_GENERATION:-250} # seconds kept for drafter training, evaluate and package
DRAFTER_SECONDS=${DRAFTER_SECONDS:-150}   # drafter optimisation time (at most)
AFTER_DRAFTER=${AFTER_DRAFTER:-100}       # seconds kept for the drafter's save, evaluate and package
CORPUS_CAP=${CORPUS_CAP:-90} TOKENIZER_CAP=${TOKENIZER_CAP:-120} TARGET_CAP=${TARGET_CAP:-285}
PROMPTS_CAP=${PROMPTS_CAP:-60} EVAL_CAP=${EVAL_CAP:-90} PACKAGE_CAP=${PACKAGE_CAP:-60}

mkdir -p "$OUT/logs" "$RUN/logs"
exec > >(tee -a "$OUT/logs/pipeline.log") 2>&1
T0=$(date +%s)
printf 'stage\tseconds\texit\n' > "$RUN/logs/timings.tsv"

# stage NAME CAP CMD...: runs CMD under a wall-clock cap (SIGINT, then SIGKILL 20 s later), logs its time.
# Returns the command's status (124 when the cap stopped it).
stage() {
    local name=$1 cap=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== [$(date +%T)] $name (cap ${cap}s, $(( start - T0 ))s elapsed): $*"
    rc=0
    timeout -s INT -k 20 "$cap" "$@" || rc=$?
    printf '%s\t%s\t%s\n' "$name" "$(( $(date +%s) - start ))" "$rc" >> "$RUN/logs/timings.tsv"
    echo "=== [$(date +%T)] $name finished in $(( $(date +%s) - start ))s (exit $rc)"
    return $rc
}

# budget WANTED RESERVE: WANTED seconds, or fewer so that RESERVE seconds remain of TOTAL_SECONDS (at least 30).
budget() {
    local left=$(( TOTAL_SECONDS - ($(date +%s) - T0) - $2 ))
    echo $(( left < $1 ? (left > 30 ? left : 30) : $1 ))
}

echo "flashdraft demo pipeline: out $OUT, work $RUN, seed $SEED, $WORKERS workers"
"$PY" - <<'PYEOF'
import sys, tokenizers, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__)
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(0))
PYEOF

stage corpus "$CORPUS_CAP" "$PY" -m flashdraft.demo.pipeline.corpus --out "$RUN/corpus" --max-mb "$CORPUS_MB" \
    --workers "$WORKERS" --seed "$SEED" --max-seconds $(( CORPUS_CAP - 30 ))

stage tokenizer "$TOKENIZER_CAP" "$PY" -m flashdraft.demo.pipeline.bpe --corpus "$RUN/corpus" \
    --out "$RUN/tokenizer" --vocab "$VOCAB" --sample-mb "$BPE_SAMPLE_MB" --model-max-length 512 --seed "$SEED"

rm -f "$RUN/logs/target.jsonl"
TARGET_S=$(budget "$TARGET_SECONDS" "$(( AFTER_TARGET + 20 ))")
echo "target: ${TARGET_S}s of training"
stage target "$TARGET_CAP" "$PY" -m flashdraft.demo.pipeline.pretrain --tokenizer "$RUN/tokenizer" \
    --out "$RUN/target" --log "$RUN/logs/target.jsonl" --hidden 384 --layers 8 --heads 6 --kv-heads 2 \
    --intermediate 1024 --seq-len 512 --batch-size 256 --lr 2e-3 --warmup 100 \
    --max-minutes "$(awk "BEGIN {print $TARGET_S / 60}")" --eval-every 200 --seed "$SEED"

stage prompts "$PROMPTS_CAP" "$PY" -m flashdraft.demo.pipeline.prompts --corpus "$RUN/corpus" --out "$RUN/prompts" \
    --train "$DRAFT_PROMPTS" --heldout 48 --seed "$SEED"

# The drafter: `flashdraft train-drafter` writes the target's own greedy responses to the prompts (cached in
# drafter_data/, with each batch's speed in generation.jsonl) for at most GEN_SECONDS, then trains on them for
# the time left to it (its learning-rate schedule follows that budget).
# Batches of 2048: at 512 the 15.7 M-parameter target is launch-bound (about 35 k tokens/s on an H200), and the
# drafter needs many distinct responses (it overfits 4 k of them: docs/demo-model-card.md). Not yet run at 2048.
GEN_S=$(budget "$GEN_SECONDS" "$(( AFTER_GENERATION ))")
DRAFTER_S=$(budget "$DRAFTER_SECONDS" "$AFTER_DRAFTER")
echo "drafter: ${GEN_S}s of response generation, then ${DRAFTER_S}s of training"
rm -rf "$RUN/drafter_train" "$RUN/drafter_data"
drafter_rc=0
stage drafter "$(( GEN_S + DRAFTER_S + 60 ))" "$PY" -m flashdraft.cli train-drafter --target "$RUN/target" \
    --prompts "$RUN/prompts/train.jsonl" --data-dir "$RUN/drafter_data" --out "$RUN/drafter_train" \
    --block-size 16 --layers 2 --tap-ids 1,4,7 --max-new-tokens 320 --gen-batch-size 2048 \
    --gen-max-minutes "$(awk "BEGIN {print $GEN_S / 60}")" --batch-size 64 --anchors 64 --lr 1e-3 \
    --steps 100000 --max-minutes "$(awk "BEGIN {print $DRAFTER_S / 60}")" --save-every 200 --eval-prompts 0 \
    --seed "$SEED" -q || drafter_rc=$?
cat "$RUN/drafter_data/generation.jsonl" 2>/dev/null || true
if [ "$drafter_rc" -ne 0 ]; then
    [ "$drafter_rc" -eq 124 ] || exit "$drafter_rc"
    echo "drafter: stopped at its cap; package exports the last checkpoint"
fi

stage evaluate "$EVAL_CAP" "$PY" -m flashdraft.demo.pipeline.evaluate --target "$RUN/target" \
    --drafter "$RUN/drafter_train" --prompts "$RUN/prompts" --out "$RUN/eval" --device cuda --max-tokens 256 \
    --speed-prompts 8 || echo "evaluate failed (exit $?): the pair is still packaged; rerun the evaluate stage"

stage package "$PACKAGE_CAP" "$PY" -m flashdraft.demo.pipeline.package --run "$RUN" --out "$OUT"

# Small outputs next to the pair: evaluation, stage statistics and logs.
cp -r "$RUN/eval" "$OUT/" 2>/dev/null || true
mkdir -p "$OUT/prompts"  # the evaluation prompts, to measure the pair again elsewhere (e.g. on a CPU)
cp "$RUN/prompts/heldout_code.jsonl" "$RUN/prompts/prose.jsonl" "$OUT/prompts/"
cp "$RUN/corpus/stats.json" "$OUT/logs/corpus_stats.json"
cp "$RUN/tokenizer/tokens/meta.json" "$OUT/logs/tokens_meta.json"
cp "$RUN/logs/target.jsonl" "$RUN/logs/timings.tsv" "$OUT/logs/"
cp "$RUN/drafter_train/train_log.jsonl" "$OUT/logs/drafter_train_log.jsonl" 2>/dev/null || true
cp "$RUN/drafter_train/train_report.json" "$OUT/logs/drafter_train_report.json" 2>/dev/null || true
echo "=== done in $(( $(date +%s) - T0 ))s: $OUT/target, $OUT/drafter, $OUT/report.md"
