#!/usr/bin/env bash
# llama.cpp (BeeLlama's llama-bench) and flashdraft side by side on the same random-weight GGUF files, on one GPU
# machine: plain decode at 0/8K/32K context, prefill of 512 and 8K tokens, flashdraft's DFlash at tau 4/6/8
# (oracle drafter), one table with the ratios (issue 18).
#
# Usage, from the repository root on the GPU machine (results and logs go to $OUT):
#     bash scripts/gpu/side_by_side.sh [--dry-run] [PHASE ...]
#     bash scripts/gpu/side_by_side.sh --print-gguf-py   (the gguf-py folder the files are written and read with,
#                                                         extracted from the bench folder's tarball if need be)
# PHASE: build | files | flashdraft | llama | table | all (the default: all five, in that order, except that
# with SBS_SERIAL=0 flashdraft runs while llama.cpp builds, which saves device time but not for a claim: the build
# on the same CPUs took 10% off flashdraft's plain decoding, 80.1 against 89.6-91.3 tok/s, docs/performance.md).
#   build       llama-bench with CUDA, by the bench folder's device_cmd.sh (about 8 min on 16 cores; detached, so
#               it goes on between calls while the machine stays warm)
#   files       make_gguf.py writes the files (about 10-20 s each; 40 GB for the three default models)
#   flashdraft  scripts/gpu/side_by_side_gguf.py measure, per file (about 3-5 min each, mostly loading, prefills of
#               8K and 32K tokens, and warm-ups)
#   llama       llama-bench -p 512,8192 -n 0 and -p 0 -n 128 -d 0,8192,32768, -ngl 99 -fa 1 -r 3, per file (about
#               1.5 min each; 2.5 for Gemma-4-31B)
#   table       the table (markdown) from whatever has been measured
# Each call stops starting work when SBS_BUDGET_S seconds of it are spent and exits 3: call it again (soon: the
# machine is given back when idle) and it goes on where it stopped. Results are kept in $SBS_WORK between calls and
# copied to $OUT at the end of every call (results.json, table.md, side_by_side.log, build.log).
# Exit codes: 0 done; 2 bad arguments or a missing input; 3 out of time for this call (call again); 4 a step failed.
#
# Knobs (environment): SBS_BENCH (the llamacpp-bench folder: make_gguf.py, device_cmd.sh, beellama-src.tar.gz;
# default ./.llamacpp-bench, a copy of ../shared/llamacpp-bench in an ignored folder, carried), SBS_WORK
# (/tmp/sbs-work), SBS_GGUF_DIR (/tmp/sbs-gguf), SBS_BUDGET_S (540), SBS_MODELS ("gemma-4-31b:q4_k_s
# qwen3-8b:q4_k_m qwen3-8b:bf16"), SBS_DEPTHS (0,8192,32768), SBS_PREFILL (512,8192), SBS_TAUS (4,6,8),
# SBS_DFLASH_PROMPT (512, prompt tokens before DFlash and its plain baseline; a list, e.g. 512,32768, for DFlash
# after each),
# SBS_TOKENS (128), SBS_REPS (3, llama-bench -r), SBS_FD_REPS (1, flashdraft's timed runs per test),
# SBS_DRAFT_WINDOW (unset: flashdraft's default drafter window, 1024; N: the last N tokens, --spec-dflash-cross-ctx;
# 0: the whole context),
# SBS_DRAFTER (auto: bf16 for float files, Q5_K blocks for quantized ones; or Q5_K, Q8_0, Q4_K, Q6_K, bf16),
# SBS_CACHE_TYPES (unset: each engine's default KV cache; K,V: both engines' target cache types, e.g. q5_0,q4_1 as
# the walkthrough's -ctk q5_0 -ctv q4_1: llama-bench -ctk K -ctv V, flashdraft --cache-types K,V; give such a run
# its own SBS_WORK, results are kept by model name),
# SBS_SERIAL (1), SBS_KEEP_GGUF (0: a file is deleted once both sides measured it),
# SBS_JOBS (16, build jobs), SBS_NEED_FD / SBS_NEED_LLAMA (330 / 200: the seconds a model's flashdraft or llama.cpp
# step must have left to start), PYTHON (python3). A llama-bench already at $SBS_WORK/bee/build-*/bin (with its
# libraries; LD_LIBRARY_PATH finding them) counts as built.
set -uo pipefail

T0=$(date +%s)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HELPER="$ROOT/scripts/gpu/side_by_side_gguf.py"
BENCH="${SBS_BENCH:-$ROOT/.llamacpp-bench}"
WORK="${SBS_WORK:-/tmp/sbs-work}"
GGUF_DIR="${SBS_GGUF_DIR:-/tmp/sbs-gguf}"
BUDGET="${SBS_BUDGET_S:-540}"
MODELS="${SBS_MODELS:-gemma-4-31b:q4_k_s qwen3-8b:q4_k_m qwen3-8b:bf16}"
DEPTHS="${SBS_DEPTHS:-0,8192,32768}"
PREFILL="${SBS_PREFILL:-512,8192}"
TAUS="${SBS_TAUS:-4,6,8}"
DFLASH_PROMPT="${SBS_DFLASH_PROMPT:-512}"
TOKENS="${SBS_TOKENS:-128}"
REPS="${SBS_REPS:-3}"
FD_REPS="${SBS_FD_REPS:-1}"
DRAFT_WINDOW="${SBS_DRAFT_WINDOW:-}"
DRAFTER="${SBS_DRAFTER:-auto}"
CACHE_TYPES="${SBS_CACHE_TYPES:-}"
SERIAL="${SBS_SERIAL:-1}"
KEEP="${SBS_KEEP_GGUF:-0}"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/out}"
RESULTS="$WORK/results"
LOG="$WORK/side_by_side.log"
export PYTHONUNBUFFERED=1
# seconds a step needs, at least (H200 estimates, see above); a step not fitting in what is left waits for the next call
NEED_FILE=60 NEED_FD=${SBS_NEED_FD:-330} NEED_LLAMA=${SBS_NEED_LLAMA:-200} NEED_BUILD_POLL=30
PENDING=0  # models skipped in this call for want of disk room

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "side_by_side.sh: $*" >&2; exit 2; }

DRY=0 PHASES=() PRINT_GGUF_PY=0
for a in "$@"; do
    case "$a" in
        --dry-run) DRY=1;;
        --print-gguf-py) PRINT_GGUF_PY=1;;
        -h|--help) usage; exit 0;;
        build|files|flashdraft|llama|table) PHASES+=("$a");;
        all) PHASES+=(build files flashdraft llama table);;
        *) die "unknown phase or option '$a' (phases: build files flashdraft llama table all; options --dry-run," \
               "--print-gguf-py)";;
    esac
done
[ ${#PHASES[@]} -gt 0 ] || PHASES=(build files flashdraft llama table)
has() { local p; for p in "${PHASES[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
for spec in $MODELS; do
    case "$spec" in
        qwen3-8b:bf16|qwen3-8b:q4_k_m|qwen3-8b:q4_k_s|qwen3-8b:q4_k|gemma-4-31b:bf16|gemma-4-31b:q4_k_m|\
        gemma-4-31b:q4_k_s|gemma-4-31b:q4_k|tiny-qwen3:*|tiny-gemma4:*) ;;
        *) die "SBS_MODELS: '$spec' is not SHAPE:TYPE of make_gguf.py (shapes qwen3-8b gemma-4-31b tiny-qwen3" \
               "tiny-gemma4; types bf16 q4_k_m q4_k_s q4_k, f32 for the tiny shapes)";;
    esac
done
for v in DEPTHS PREFILL TAUS DFLASH_PROMPT; do [[ "${!v}" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "SBS_$v must be comma-separated numbers, got '${!v}'"; done
for v in BUDGET TOKENS REPS FD_REPS; do [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a whole number, got '${!v}'"; done
[[ -z "$DRAFT_WINDOW" || "$DRAFT_WINDOW" =~ ^[0-9]+$ ]] || die "SBS_DRAFT_WINDOW must be a whole number, got '$DRAFT_WINDOW'"
case "$DRAFTER" in auto|Q5_K|Q8_0|Q4_K|Q6_K|bf16) ;; *) die "SBS_DRAFTER must be auto, Q5_K, Q8_0, Q4_K, Q6_K or bf16, got '$DRAFTER'";; esac
KV_TYPE='(f16|bf16|q8_0|q5_0|q5_1|q4_0|q4_1)'
[[ -z "$CACHE_TYPES" || "$CACHE_TYPES" =~ ^$KV_TYPE,$KV_TYPE$ ]] \
    || die "SBS_CACHE_TYPES must be K,V of f16 bf16 q8_0 q5_0 q5_1 q4_0 q4_1, got '$CACHE_TYPES'"
drafter_for() {  # auto: a bf16 drafter for a float file, Q5_K blocks (the walkthrough drafter's type) for a quantized one
    if [ "$DRAFTER" != auto ]; then echo "$DRAFTER"; else case "${1##*:}" in bf16|f32) echo bf16;; *) echo Q5_K;; esac; fi
}

el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(el) )); }
say() { echo "[$(date -u +%H:%M:%S) +$(el)s] $*" | tee -a "$LOG"; }
name_of() { echo "${1%%:*}__${1##*:}"; }
exec 3>&1  # the terminal, for --dry-run's printout whatever a command's output is sent to
run() {  # a command, or its printout under --dry-run
    if [ $DRY = 1 ]; then echo "would run: $*" >&3; return 0; fi
    "$@"
}

collect() {  # what this call returns, whatever happened
    [ $DRY = 1 ] && return 0
    mkdir -p "$OUT"
    PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HELPER" table "$RESULTS" --md "$OUT/table.md" \
        --json "$OUT/results.json" 2>&1 | tee -a "$LOG" || true
    cp -f "$LOG" "$OUT/side_by_side.log"
    [ -s "$WORK/bee-out/build.log" ] && tail -c 4000000 "$WORK/bee-out/build.log" > "$OUT/build.log"
    return 0
}
finish() { say "exit $1"; collect; exit "$1"; }

bee() {  # device_cmd.sh with no models: it builds llama-bench (detached) and returns within $1 seconds
    if [ $DRY = 1 ]; then echo "would run: BEE_BUDGET_S=$1 BEE_MODELS= bash $BENCH/device_cmd.sh"; return 0; fi
    BEE_WORK="$WORK/bee" BEE_MODELS="" BEE_BUDGET_S="$1" BEE_JOBS="${SBS_JOBS:-16}" OUT="$WORK/bee-out" \
        bash "$BENCH/device_cmd.sh" >> "$LOG" 2>&1
}
llama_bench() { ls "$WORK"/bee/build-*/bin/llama-bench 2>/dev/null | head -1; }
build_running() { local p; for p in "$WORK"/bee/build-*.pid; do [ -f "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null && return 0; done; return 1; }

gguf_py() {  # gguf-py (llama.cpp's, from the tarball) for make_gguf.py and flashdraft: the machine has none
    local dir="$WORK/gguf-py/beellama/gguf-py"
    if [ ! -f "$dir/gguf/__init__.py" ] && [ $DRY = 0 ]; then
        mkdir -p "$WORK/gguf-py" && tar -xzf "$BENCH/beellama-src.tar.gz" -C "$WORK/gguf-py" beellama/gguf-py \
            || { say "cannot extract gguf-py from $BENCH/beellama-src.tar.gz"; finish 2; }
    fi
    echo "$dir"
}
if [ $PRINT_GGUF_PY = 1 ]; then
    [ -f "$BENCH/beellama-src.tar.gz" ] || die "$BENCH must hold beellama-src.tar.gz (copy ../shared/llamacpp-bench)"
    mkdir -p "$WORK"
    gguf_py
    exit 0
fi

phase_build_start() {
    if [ -n "$(llama_bench)" ] && ! build_running; then say "llama-bench built: $(llama_bench)"; return 0; fi
    say "build: starting or resuming llama-bench's build (device_cmd.sh, detached)"
    bee 60; local rc=$?
    [ $rc = 0 ] || [ $rc = 3 ] || { say "device_cmd.sh failed (status $rc)"; tail -20 "$WORK/bee-out/device.log" 2>/dev/null; finish 4; }
}

phase_build_wait() {
    if [ -n "$(llama_bench)" ] && ! build_running; then return 0; fi
    [ "$(left)" -ge $NEED_BUILD_POLL ] || { say "build: no time left to wait for it -- call again"; finish 3; }
    say "build: waiting for it ($(left) s left in this call)"
    bee "$(( $(left) - 10 ))"; local rc=$?
    if [ $rc = 3 ]; then say "build: still running -- call again"; finish 3; fi
    [ $DRY = 1 ] && return 0
    [ $rc = 0 ] && [ -n "$(llama_bench)" ] || { say "build failed (status $rc)"; finish 4; }
}

size_gb() {  # a file's size, rounded up (make_gguf.py --dry-run gives the exact one)
    case "$1" in gemma-4-31b:bf16) echo 62;; gemma-4-31b:*) echo 19;; qwen3-8b:bf16) echo 17;; qwen3-8b:*) echo 6;;
                 *) echo 1;; esac
}

ensure_file() {  # writes the model's file unless it is there; status 1 (and a note) when the disk has no room now
    local spec="$1" gp nm; nm=$(name_of "$spec"); local f="$GGUF_DIR/$nm.gguf"
    [ -f "$f" ] && return 0
    [ "$(left)" -ge $NEED_FILE ] || { say "files: no time left to write $nm -- call again"; finish 3; }
    run mkdir -p "$GGUF_DIR"
    local free; free=$(df -P -B1G "$GGUF_DIR" 2>/dev/null | awk 'NR==2 {print $4}')
    if [ $DRY = 0 ] && [ "${free:-0}" -lt $(( $(size_gb "$spec") + 4 )) ]; then
        say "files: no room for $nm now ($free GB free); it is written once measured files are deleted"
        PENDING=$(( PENDING + 1 )); return 1
    fi
    gp=$(gguf_py)
    say "files: writing $f ($free GB free)"
    run timeout $(( $(left) - 5 )) "$PY" "$BENCH/make_gguf.py" --shape "${spec%%:*}" --type "${spec##*:}" \
        -o "$f" --gguf-py "$gp" >> "$LOG" 2>&1 || { say "files: make_gguf.py failed for $spec"; finish 4; }
}

phase_files() {
    local spec nm
    for spec in $MODELS; do
        nm=$(name_of "$spec")
        [ -s "$RESULTS/flashdraft-$nm.json" ] && [ -s "$RESULTS/llama-$nm.json" ] && continue
        ensure_file "$spec" || true
    done
}

phase_flashdraft() {
    local spec gp busy=(); gp=$(gguf_py)
    if [ $DRY = 0 ] && build_running; then busy+=(--build-running); fi
    for spec in $MODELS; do
        local nm extra=("${busy[@]}"); nm=$(name_of "$spec"); local f="$GGUF_DIR/$nm.gguf"
        case "$spec" in tiny-*) extra+=(--tiny);; esac
        [ -n "$DRAFT_WINDOW" ] && extra+=(--draft-window "$DRAFT_WINDOW")
        [ -n "$CACHE_TYPES" ] && extra+=(--cache-types "$CACHE_TYPES")
        [ -s "$RESULTS/flashdraft-$nm.json" ] && { say "flashdraft: $nm measured in an earlier call"; continue; }
        ensure_file "$spec" || continue
        [ "$(left)" -ge $NEED_FD ] || { say "flashdraft: not enough time left for $nm -- call again"; finish 3; }
        say "flashdraft: $nm"
        PYTHONPATH="$ROOT/src:$gp" run timeout $(( $(left) - 10 )) "$PY" "$HELPER" measure "$f" \
            "$RESULTS/flashdraft-$nm.json.part" --depths "$DEPTHS" --prefill "$PREFILL" --taus "$TAUS" \
            --dflash-prompt "$DFLASH_PROMPT" --tokens "$TOKENS" --reps "$FD_REPS" --drafter "$(drafter_for "$spec")" "${extra[@]}" 2>&1 | tee -a "$LOG"
        local rc=${PIPESTATUS[0]}
        [ $DRY = 1 ] && continue
        [ -s "$RESULTS/flashdraft-$nm.json.part" ] && mv -f "$RESULTS/flashdraft-$nm.json.part" "$RESULTS/flashdraft-$nm.json"
        if [ "$rc" = 124 ]; then say "flashdraft: $nm ran out of this call's time (kept what it measured)"; finish 3; fi
        [ "$rc" = 0 ] || say "flashdraft: $nm ended with status $rc (errors are in its JSON)"
        drop_file "$nm"
    done
}

phase_llama() {
    local spec bin; bin=$(llama_bench)
    [ -n "$bin" ] || [ $DRY = 1 ] || { say "llama: no llama-bench built (phase build)"; finish 4; }
    # a carried build (llama_bench_prebuilt.sh unpack) finds its libraries so; a build made here needs nothing
    local libs; libs="$(bash "$ROOT/scripts/gpu/llama_bench_prebuilt.sh" cublas-dir)"
    [ -z "$bin" ] || export LD_LIBRARY_PATH="$libs:$(dirname "$bin"):${LD_LIBRARY_PATH:-}"
    for spec in $MODELS; do
        local nm; nm=$(name_of "$spec"); local f="$GGUF_DIR/$nm.gguf" part="$RESULTS/llama-$nm.json.part"
        [ $DRY = 1 ] && part=/dev/null
        [ -s "$RESULTS/llama-$nm.json" ] && { say "llama: $nm measured in an earlier call"; continue; }
        ensure_file "$spec" || continue
        [ "$(left)" -ge $NEED_LLAMA ] || { say "llama: not enough time left for $nm -- call again"; finish 3; }
        say "llama: $nm"
        [ $DRY = 1 ] || rm -f "$part"
        local args rc=0 types=()
        [ -n "$CACHE_TYPES" ] && types=(-ctk "${CACHE_TYPES%,*}" -ctv "${CACHE_TYPES#*,}")
        for args in "-p $PREFILL -n 0" "-p 0 -n $TOKENS -d $DEPTHS"; do
            # shellcheck disable=SC2086
            run timeout $(( $(left) - 10 )) "${bin:-llama-bench}" -m "$f" $args -ngl 99 -fa 1 "${types[@]}" \
                -r "$REPS" -o json -oe md >> "$part" 2>> "$LOG" || { rc=$?; break; }
        done
        [ $DRY = 1 ] && continue
        grep -E "^\|" "$LOG" | tail -6
        if [ $rc = 124 ]; then say "llama: $nm ran out of this call's time -- call again"; finish 3; fi
        [ $rc = 0 ] || { say "llama: llama-bench failed for $nm (status $rc)"; finish 4; }
        mv -f "$part" "$RESULTS/llama-$nm.json"
        drop_file "$nm"
    done
}

drop_file() {  # a file both sides measured makes room for the next one
    [ "$KEEP" = 1 ] && return 0
    [ -s "$RESULTS/flashdraft-$1.json" ] && [ -s "$RESULTS/llama-$1.json" ] && rm -f "$GGUF_DIR/$1.gguf"
    return 0
}

main() {
    [ -f "$BENCH/make_gguf.py" ] && [ -f "$BENCH/device_cmd.sh" ] && [ -f "$BENCH/beellama-src.tar.gz" ] \
        || die "$BENCH must hold make_gguf.py, device_cmd.sh and beellama-src.tar.gz (copy ../shared/llamacpp-bench)"
    [ -f "$HELPER" ] || die "missing $HELPER"
    mkdir -p "$RESULTS"
    [ $DRY = 1 ] || mkdir -p "$OUT"
    say "side_by_side.sh: phases ${PHASES[*]}; models $MODELS; budget ${BUDGET}s; work $WORK"
    [ $DRY = 1 ] || { nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"; }
    if has build; then phase_build_start; [ "$SERIAL" = 1 ] && phase_build_wait; fi
    if has files; then phase_files; fi
    if has flashdraft; then phase_flashdraft; fi
    if has llama; then
        if has build; then phase_build_wait; fi
        phase_llama
    fi
    if [ $PENDING -gt 0 ]; then say "$PENDING model(s) waited for disk room -- call again"; finish 3; fi
    finish 0
}

main
