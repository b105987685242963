#!/usr/bin/env bash
# Speculative decoding's benchmark: kiln without and with --speculative ngram, and llama.cpp's
# llama-server without and with its own n-gram drafting (--spec-type ngram-simple, with that
# build's own lookup and draft lengths: 12 and 48 tokens in build 11434) where its binary is
# found, on the same GGUF, `kiln bench`'s drafting workloads (kiln/bench/spec_prompts.py):
#   editing  the reply copies a given function with one variable renamed
#   quoting  the reply copies a short document, then says what it is about
#   free     a short story: the prompt foretells nothing
# Greedy, penalties off: a reply is the same with and without drafting, so both do the same
# work. The two servers of a pair (without and with drafting) are up at once and alternate,
# one workload at a time, REPS times over (other prompts each time, the same on both): a
# shared machine's drift falls on both alike. bench/spec_report.py writes the table.
#
#   bench/spec.sh                                       # smollm2:135m, levels 1,16, 3 runs
#   MODEL=qwen2.5-coder:0.5b REPS=1 bench/spec.sh
#   LEVELS=1 REQUESTS=2 MAX_TOKENS=32 REPS=1 bench/spec.sh   # a quick check
#
# Environment: MODEL (smollm2:135m)  LEVELS (1,16)  REQUESTS (per level; 0 = kiln bench's
#              default)  REPS (3)  MAX_TOKENS (192)  K (kiln's --num-speculative-tokens; unset: its default)
#              CTX (4096)  THREADS (the CPU count)  OUT (bench/results)
#              LLAMA_SERVER (as bench/compare.sh finds it; none found: kiln only)
#              LLAMA_NO_REPACK=1 (llama-server --no-repack, as in bench/compare.sh: only where
#              its repacked path crashes; it slows llama.cpp, so say so beside its figures)
# Writes OUT/STAMP-spec-LABEL.json per server and OUT/STAMP-spec.txt (the table).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
MODEL=${MODEL:-smollm2:135m}
LEVELS=${LEVELS:-1,16}
REQUESTS=${REQUESTS:-0}
REPS=${REPS:-3}
MAX_TOKENS=${MAX_TOKENS:-192}
K=${K:-$("$PY" -c "from kiln.runtime.drafting.config import SpeculativeConfig as S; print(S().num_speculative_tokens)")}
LLAMA_NO_REPACK=${LLAMA_NO_REPACK:-0}
CTX=${CTX:-4096}
THREADS=${THREADS:-$("$PY" -c 'import os; print(os.cpu_count())')}
OUT=${OUT:-bench/results}
START_TIMEOUT=${START_TIMEOUT:-600}
STAMP=$(date -u +%Y%m%d-%H%M%S)
STOP_WAIT_S=20
LLAMA_BIN_DIR=""
[ -r /root/llama.cpp/BIN_DIR ] && LLAMA_BIN_DIR=$(head -n 1 /root/llama.cpp/BIN_DIR)
LLAMA_SERVER=${LLAMA_SERVER:-${LLAMA_BIN_DIR:+$LLAMA_BIN_DIR/}llama-server}
source "$(dirname "$0")/server_lib.sh"
GGUF=$(.venv/bin/kiln pull "$MODEL" | tail -n 1)
mkdir -p "$OUT"
MAX_LEVEL=$(tr ',' '\n' <<<"$LEVELS" | sort -n | tail -n 1)

declare -A PORTS PIDS
stop_all() {
    for label in "${!PIDS[@]}"; do
        SERVER_PID=${PIDS[$label]}
        stop_server
    done
    PIDS=()
}
trap 'stop_all; rm -rf "$WORK"' EXIT

# start LABEL COMMAND...: in the background on a free port, until /health answers 200.
start() {
    local label=$1 log="$WORK/$1.log" port
    shift
    port=$(free_port)
    "$@" --port "$port" >>"$log" 2>&1 &
    PIDS[$label]=$!
    PORTS[$label]=$port
    wait_ready "$label" "http://127.0.0.1:$port/health" "${PIDS[$label]}" "$log"
}

# bench LABEL KIND REP: one workload at every level, kiln's counters read around it.
bench() {
    local url="http://127.0.0.1:${PORTS[$1]}" name="$1-$2-$3"
    curl -sf "$url/metrics" >"$WORK/$name.before" || true
    # --no-ignore-eos: a workload is its reply (the copied function, the quoted text), not
    # what the model would write past its end, where drafting finds something else to copy.
    .venv/bin/kiln bench --base-url "$url/v1" --label "$1" --model "$MODEL" --prompts "$2" \
        --no-ignore-eos \
        --concurrency "$LEVELS" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" --warmup 1 \
        --seed "$3" --quiet --out "$WORK/$name.json" --chart "$WORK/$name.png"
    curl -sf "$url/metrics" >"$WORK/$name.after" || true
}

# pair PLAIN DRAFTING: each workload on one, then on the other, REPS times.
pair() {
    for rep in $(seq 1 "$REPS"); do
        for kind in editing quoting free; do
            bench "$1" "$kind" "$rep"
            bench "$2" "$kind" "$rep"
        done
    done
}

LABELS=(kiln kiln-ngram)
start kiln .venv/bin/kiln serve "$MODEL" --host 127.0.0.1 --ctx-len "$CTX"
start kiln-ngram .venv/bin/kiln serve "$MODEL" --host 127.0.0.1 --ctx-len "$CTX" \
    --speculative ngram --num-speculative-tokens "$K"
pair kiln kiln-ngram
stop_all
if command -v "$LLAMA_SERVER" >/dev/null; then
    ARGS=(-m "$GGUF" --alias "$MODEL" -t "$THREADS" -tb "$THREADS" --host 127.0.0.1
          -np "$MAX_LEVEL" -c $((CTX * MAX_LEVEL)) --cont-batching --no-kv-unified)
    [ "$LLAMA_NO_REPACK" = 1 ] && ARGS+=(--no-repack)
    start llama-server "$LLAMA_SERVER" "${ARGS[@]}"
    start llama-server-ngram "$LLAMA_SERVER" "${ARGS[@]}" --spec-type ngram-simple
    pair llama-server llama-server-ngram
    stop_all
    LABELS+=(llama-server llama-server-ngram)
fi
"$PY" bench/spec_report.py "$WORK" "$OUT/$STAMP-spec" "$MODEL" "$THREADS" "$K" "${LABELS[@]}" \
    | tee "$OUT/$STAMP-spec.txt"
if [ "$LLAMA_NO_REPACK" = 1 ] && [[ " ${LABELS[*]} " == *" llama-server "* ]]; then
    echo "llama-server ran with --no-repack (its repacked path crashes here), which slows it" \
        | tee -a "$OUT/$STAMP-spec.txt"
fi
