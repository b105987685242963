#!/usr/bin/env bash
# kiln against llama.cpp's own C++ server (llama-server, continuous batching) on the same GGUF,
# context length, thread count, prompts and levels: each server in turn on a free loopback
# port, `kiln bench` against it, the server stopped; then llama-bench (llama.cpp in process,
# no HTTP), the kiln / llama-server ratio table and the merged chart.
#
#   bench/compare.sh                                         # the full comparison (long)
#   LEVELS=1,2 REQUESTS=2 MAX_TOKENS=8 LONG_TOKENS=300 bench/compare.sh   # a quick check
#
# Environment: LLAMA_SERVER  the llama-server binary (default: $(cat /root/llama.cpp/BIN_DIR)/
#                            llama-server when that file exists, else llama-server on PATH);
#                            built from source, see bench/README.md
#              LLAMA_BENCH   the llama-bench binary, found the same way
#              MODEL (smollm2:135m)  GGUF (default: the file `kiln pull MODEL` prints)
#              CTX (4096: kiln's --ctx-len, and each llama-server slot's context)
#              THREADS (llama.cpp's -t and -tb; default the CPU count, which is what kiln uses)
#              SLOTS (16)  llama-server's -np; it is raised to the highest level of LEVELS, so
#                            every stream of every level has a slot of its own (LEVELS 1,16,64:
#                            -np 64). llama-server splits -c between its slots, so it gets
#                            -c CTX*slots --no-kv-unified: CTX tokens for each slot (its KV cache
#                            is allocated up front: 64 slots x 4096 tokens is about 6 GB of f16
#                            K/V for smollm2:135m)
#              LONG_SLOTS    unset (the default): the long and shared-prefix prompts run against
#                            the same llama-server as the short ones. LONG_SLOTS=1 restarts it
#                            with -np 1 -c CTX for them (the slot count does not change the work
#                            of one request at concurrency 1; this is there to check it)
#              LEVELS (short-prompt concurrency, 1,16,64)  REQUESTS (per level; 0 = kiln bench's
#              default)  MAX_TOKENS (128)  LONG_TOKENS (2000)  LONG_REQUESTS (REQUESTS)
#              WARMUP (2)  OUT (bench/results)  START_TIMEOUT (600 s)
#              BENCH_REPS (5)  llama-bench's -r (repetitions of pp512 and of tg64)
#              KILN_DTYPES  kiln's --dtype for each kiln server, in turn (auto, the default:
#                            8-bit activations on the CPU; "auto float32" adds a kiln-fp32
#                            server (fp32 products) and its own ratio table, bfloat16 a
#                            kiln-bf16 one; "none" runs llama.cpp alone)
#              LLAMA_NO_REPACK=1  llama-server --no-repack and llama-bench --repack 0: llama.cpp's
#                            weights without its CPU repacking (AMX / AVX-512 layouts), only where
#                            that path crashes; it slows llama.cpp, so say so beside its figures
# llama-server runs with continuous batching (--cont-batching), its prompt cache on (its
# default), the GGUF's chat template (--jinja, its default), --alias MODEL so the model name
# matches, and --no-ui. The long and shared-prefix prompts run at concurrency 1 only (prefill
# speed, cached vs cold).
# Writes OUT/STAMP-{kiln,kiln-bf16,llama-server}-{short,long}.json, OUT/STAMP-llama-bench.json
# (llama-bench -p 512 -n 64 -o json) and OUT/STAMP-compare.{png,txt}.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
KILN=.venv/bin/kiln
LLAMA_BIN_DIR=""
[ -r /root/llama.cpp/BIN_DIR ] && LLAMA_BIN_DIR=$(head -n 1 /root/llama.cpp/BIN_DIR)
LLAMA_SERVER=${LLAMA_SERVER:-${LLAMA_BIN_DIR:+$LLAMA_BIN_DIR/}llama-server}
LLAMA_BENCH=${LLAMA_BENCH:-${LLAMA_BIN_DIR:+$LLAMA_BIN_DIR/}llama-bench}
MODEL=${MODEL:-smollm2:135m}
CTX=${CTX:-4096}
THREADS=${THREADS:-$("$PY" -c 'import os; print(os.cpu_count())')}
SLOTS=${SLOTS:-16}
LONG_SLOTS=${LONG_SLOTS:-}
LEVELS=${LEVELS:-1,16,64}
REQUESTS=${REQUESTS:-0}
MAX_TOKENS=${MAX_TOKENS:-128}
LONG_TOKENS=${LONG_TOKENS:-2000}
WARMUP=${WARMUP:-2}
LONG_REQUESTS=${LONG_REQUESTS:-$REQUESTS}
BENCH_REPS=${BENCH_REPS:-5}
LLAMA_NO_REPACK=${LLAMA_NO_REPACK:-0}
KILN_DTYPES=${KILN_DTYPES:-auto}
[ "$KILN_DTYPES" = none ] && KILN_DTYPES=""
OUT=${OUT:-bench/results}
START_TIMEOUT=${START_TIMEOUT:-600}
STAMP=$(date -u +%Y%m%d-%H%M%S)
STOP_WAIT_S=20
source "$(dirname "$0")/server_lib.sh"

for bin in "$LLAMA_SERVER" "$LLAMA_BENCH"; do
    if ! command -v "$bin" >/dev/null; then
        echo "compare.sh: no llama.cpp binary at $bin; build llama-server and llama-bench" >&2
        echo "(bench/README.md, 'kiln against llama.cpp') and write their directory to" >&2
        echo "/root/llama.cpp/BIN_DIR, or point LLAMA_SERVER and LLAMA_BENCH at them." >&2
        exit 2
    fi
done
GGUF=${GGUF:-$(.venv/bin/kiln pull "$MODEL" | tail -n 1)}
mkdir -p "$OUT"

# Slots: one per stream of the highest level, at least SLOTS.
MAX_LEVEL=$(tr ',' '\n' <<<"$LEVELS" | sort -n | tail -n 1)
NP=$((SLOTS > MAX_LEVEL ? SLOTS : MAX_LEVEL))

# llama-server's flags, each only where this build has it (--no-repack is required when asked).
HELP=$("$LLAMA_SERVER" --help 2>&1 || true)
has_flag() { grep -q -e "\(^\|[ ,]\)$1\([ ,]\|$\)" <<<"$HELP"; }
LLAMA_ARGS=(-m "$GGUF" --alias "$MODEL" -t "$THREADS" -tb "$THREADS" --host 127.0.0.1)
for flag in --cont-batching --no-kv-unified --no-ui; do
    has_flag "$flag" && LLAMA_ARGS+=("$flag")
done
BENCH_ARGS=(-m "$GGUF" -t "$THREADS" -p 512 -n 64 -r "$BENCH_REPS" -o json)
if [ "$LLAMA_NO_REPACK" = 1 ]; then
    if ! has_flag --no-repack; then
        echo "compare.sh: this llama-server has no --no-repack flag" >&2
        exit 2
    fi
    LLAMA_ARGS+=(--no-repack)
    BENCH_ARGS+=(--repack 0)
fi


# start LABEL READY_PATH COMMAND...: runs the server in the background, waits until READY_PATH
# answers 200 (the model is loaded), or fails with the end of its log.
start() {
    local label=$1 ready=$2 log="$WORK/$1.log"
    shift 2
    "$@" >>"$log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$label" "http://127.0.0.1:$PORT$ready" "$SERVER_PID" "$log"
}

# start_llama SLOTS: llama-server with SLOTS slots of CTX tokens each.
start_llama() {
    PORT=$(free_port)
    start llama-server /health "$LLAMA_SERVER" "${LLAMA_ARGS[@]}" -np "$1" -c $((CTX * $1)) \
        --port "$PORT"
    grep -h "n_ctx_slot" "$WORK/llama-server.log" | tail -n 1 | sed 's/^/[compare]  /' >&2 || true
}

STATUS=0
check_alive() {
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "compare.sh: $1 died during the benchmark; the end of its log:" >&2
        tail -n 30 "$WORK/$1.log" >&2
        STATUS=1
    fi
}
ARGS=(--model "$MODEL" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" --warmup "$WARMUP")
# bench_short LABEL: the short prompts at LEVELS. bench_long LABEL: long and shared-prefix at 1.
bench_short() {
    "$KILN" bench --base-url "http://127.0.0.1:$PORT/v1" --label "$1" "${ARGS[@]}" \
        --prompts short --concurrency "$LEVELS" \
        --out "$OUT/$STAMP-$1-short.json" --chart "$WORK/$1-short.png" || STATUS=1
    check_alive "$1"
}
bench_long() {
    "$KILN" bench --base-url "http://127.0.0.1:$PORT/v1" --label "$1" "${ARGS[@]}" \
        --prompts long,shared-prefix --concurrency 1 --requests "$LONG_REQUESTS" \
        --long-tokens "$LONG_TOKENS" --out "$OUT/$STAMP-$1-long.json" \
        --chart "$WORK/$1-long.png" || STATUS=1
    check_alive "$1"
}

KILN_LABELS=()
for dtype in $KILN_DTYPES; do
    label=kiln
    [ "$dtype" = auto ] || label=kiln-${dtype/bfloat16/bf16}
    label=${label/float32/fp32}
    KILN_LABELS+=("$label")
    PORT=$(free_port)
    start "$label" /health .venv/bin/kiln serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
        --ctx-len "$CTX" --dtype "$dtype"
    bench_short "$label"
    bench_long "$label"
    stop_server
done

start_llama "$NP"
bench_short llama-server
if [ -n "$LONG_SLOTS" ] && [ "$LONG_SLOTS" != "$NP" ]; then
    stop_server
    start_llama "$LONG_SLOTS"
fi
bench_long llama-server
stop_server

# llama.cpp in process: pp512 (prefill) and tg64 (decode), each BENCH_REPS times.
echo "[compare]  llama-bench ${BENCH_ARGS[*]}" >&2
"$LLAMA_BENCH" "${BENCH_ARGS[@]}" >"$OUT/$STAMP-llama-bench.json" 2>"$WORK/llama-bench.log" || {
    echo "compare.sh: llama-bench failed; the end of its log:" >&2
    tail -n 30 "$WORK/llama-bench.log" >&2
    STATUS=1
}

VERSION=$("$LLAMA_SERVER" --version 2>&1 | grep -m 1 '^version' || echo "version unknown")
echo "kiln vs llama-server ($VERSION): $MODEL, ctx $CTX per sequence, $THREADS threads," \
     "llama-server -np $NP${LONG_SLOTS:+ (long prompts: -np $LONG_SLOTS)}," \
     "max_tokens $MAX_TOKENS, long prompts $LONG_TOKENS words," \
     "llama.cpp no-repack $LLAMA_NO_REPACK, kiln --dtype: ${KILN_DTYPES:-none}" \
     | tee "$OUT/$STAMP-compare.txt"
FILES=()
for label in "${KILN_LABELS[@]}"; do
    PAIR=("$OUT/$STAMP-$label"-{short,long}.json "$OUT/$STAMP"-llama-server-{short,long}.json)
    "$KILN" bench --compare "${PAIR[@]}" | tee -a "$OUT/$STAMP-compare.txt"
    FILES+=("$OUT/$STAMP-$label"-{short,long}.json)
done
"$PY" - "$OUT/$STAMP-llama-bench.json" "$THREADS" <<'EOF' | tee -a "$OUT/$STAMP-compare.txt" || STATUS=1
import json, sys
rows = json.load(open(sys.argv[1]))
def test(n_prompt, n_gen):
    r = next(r for r in rows if r["n_prompt"] == n_prompt and r["n_gen"] == n_gen)
    return f"{r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} tok/s"
print(f"llama-bench (in process, {sys.argv[2]} threads, {len(rows[0]['samples_ts'])} runs each):"
      f" pp512 {test(512, 0)}, tg64 {test(0, 64)}")
EOF
FILES+=("$OUT/$STAMP"-llama-server-{short,long}.json)
"$KILN" bench --plot "${FILES[@]}" --chart "$OUT/$STAMP-compare.png"
echo "$OUT/$STAMP-compare.png"
exit $STATUS
