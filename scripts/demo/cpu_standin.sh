#!/usr/bin/env bash
# The CPU stand-in demo pair that ships today (docs/demo-model-card.md): the GPU pipeline's stages at small sizes,
# about 25 minutes on 2 CPU cores. Usage: scripts/demo/cpu_standin.sh RUN_DIR OUT_DIR
set -euo pipefail
R=$(realpath -m "${1:?usage: cpu_standin.sh RUN_DIR OUT_DIR}")
OUT=$(realpath -m "${2:?usage: cpu_standin.sh RUN_DIR OUT_DIR}")
cd "$(dirname "$0")/../.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
python -m flashdraft.demo.pipeline.corpus --out "$R/corpus" --max-mb 24 --workers 2 --seed 0 --max-seconds 120
python -m flashdraft.demo.pipeline.bpe --corpus "$R/corpus" --out "$R/tokenizer" --vocab 4096 --sample-mb 6 \
    --model-max-length 512 --seed 0
python -m flashdraft.demo.pipeline.pretrain --tokenizer "$R/tokenizer" --out "$R/target" --log "$R/logs/target.jsonl" \
    --hidden 192 --layers 4 --heads 3 --kv-heads 1 --intermediate 576 --seq-len 256 --batch-size 16 --lr 3e-3 \
    --warmup 30 --max-minutes 13 --eval-every 100 --device cpu --seed 0
python -m flashdraft.demo.pipeline.prompts --corpus "$R/corpus" --out "$R/prompts" --train 512 --heldout 24 \
    --max-chars 320 --seed 0
python -m flashdraft.cli train-drafter --target "$R/target" --prompts "$R/prompts/train.jsonl" \
    --data-dir "$R/drafter_data" --out "$R/drafter_train" --block-size 16 --layers 1 --tap-ids 1,2 \
    --max-new-tokens 128 --gen-batch-size 128 --batch-size 16 --anchors 32 --lr 2e-3 --steps 500 \
    --eval-prompts 0 --device cpu --seed 0 -q
python -m flashdraft.demo.pipeline.evaluate --target "$R/target" --drafter "$R/drafter_train" --prompts "$R/prompts" \
    --out "$R/eval" --device cpu --max-tokens 128 --speed-prompts 4
python -m flashdraft.demo.pipeline.package --run "$R" --out "$OUT"
