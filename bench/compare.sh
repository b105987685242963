#!/usr/bin/env bash
# kiln against llama.cpp's OpenAI server (llama-cpp-python) on the same GGUF, context length,
# thread count, prompts and levels: each server in turn on a free loopback port, bench/serve.py
# against it, the server stopped; then the kiln / llama.cpp ratio table and the merged chart.
#
#   bench/compare.sh                                         # the full comparison (long)
#   LEVELS=1,2 REQUESTS=2 MAX_TOKENS=8 LONG_TOKENS=300 bench/compare.sh   # a quick check
#
# Environment: LLAMA_CPP_PY  python of a venv with llama-cpp-python[server] (kiln's `.[compare]`
#                            extra, compiled from source; default /root/lcpp/bin/python)
#              MODEL (smollm2:135m)  CTX (4096)  THREADS (llama.cpp's n_threads; default the
#              CPU count, which is what kiln uses)  LEVELS (short-prompt concurrency, 1,16,64)
#              REQUESTS (per level; 0 = serve.py's default)  MAX_TOKENS (128)
#              LONG_TOKENS (2000)  LONG_REQUESTS (REQUESTS)  WARMUP (2)  OUT (bench/results)  START_TIMEOUT (600 s)
#              KILN_DTYPES  kiln's --dtype for each kiln server, in turn (float32; "float32
#                            bfloat16" adds a kiln-bf16 server and its own ratio table)
#              LLAMA_CPP_NO_REPACK=1  load llama.cpp's weights without its extra buffer types
#                            (AMX / AVX-512 repacking): only where that path crashes (a
#                            segfault in llama_decode on the first request); it slows llama.cpp
# The long and shared-prefix prompts run at concurrency 1 only (prefill speed, cached vs cold).
# llama-cpp-python's server answers one request at a time; --interrupt_requests False makes
# it queue concurrent requests instead of cutting the running stream short.
# Writes OUT/STAMP-{kiln,kiln-bf16,llamacpp}-{short,long}.json, OUT/STAMP-compare.{png,txt}.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
LLAMA_CPP_PY=${LLAMA_CPP_PY:-/root/lcpp/bin/python}
MODEL=${MODEL:-smollm2:135m}
CTX=${CTX:-4096}
THREADS=${THREADS:-$("$PY" -c 'import os; print(os.cpu_count())')}
LEVELS=${LEVELS:-1,16,64}
REQUESTS=${REQUESTS:-0}
MAX_TOKENS=${MAX_TOKENS:-128}
LONG_TOKENS=${LONG_TOKENS:-2000}
WARMUP=${WARMUP:-2}
LONG_REQUESTS=${LONG_REQUESTS:-$REQUESTS}
LLAMA_CPP_NO_REPACK=${LLAMA_CPP_NO_REPACK:-0}
KILN_DTYPES=${KILN_DTYPES:-float32}
OUT=${OUT:-bench/results}
START_TIMEOUT=${START_TIMEOUT:-600}
STAMP=$(date -u +%Y%m%d-%H%M%S)
WORK=$(mktemp -d)
SERVER_PID=""

if ! "$LLAMA_CPP_PY" -c 'import llama_cpp.server' 2>/dev/null; then
    echo "compare.sh: $LLAMA_CPP_PY cannot import llama_cpp.server; make a venv with" >&2
    echo "  python3 -m venv /root/lcpp && /root/lcpp/bin/pip install 'llama-cpp-python[server]'" >&2
    echo "or point LLAMA_CPP_PY at one." >&2
    exit 2
fi
GGUF=$(.venv/bin/kiln pull "$MODEL" | tail -n 1)
mkdir -p "$OUT"

stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill -INT "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 80); do
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.25
    done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap 'stop_server; rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start LABEL READY_PATH COMMAND...: runs the server in the background, waits until READY_PATH
# answers 200 (the model is loaded), or fails with the end of its log.
start() {
    local label=$1 ready=$2 log="$WORK/$1.log"
    shift 2
    "$@" >"$log" 2>&1 &
    SERVER_PID=$!
    local deadline=$((SECONDS + START_TIMEOUT))
    until curl -sf -o /dev/null "http://127.0.0.1:$PORT$ready"; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
            echo "compare.sh: $label did not become ready on port $PORT:" >&2
            tail -n 30 "$log" >&2
            exit 1
        fi
        sleep 0.5
    done
    echo "[compare]  $label ready on port $PORT" >&2
}

# bench LABEL: the short prompts at LEVELS, then long and shared-prefix at concurrency 1.
STATUS=0
bench() {
    local args=(--base-url "http://127.0.0.1:$PORT/v1" --label "$1" --model "$MODEL"
                --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" --warmup "$WARMUP")
    "$PY" bench/serve.py "${args[@]}" --prompts short --concurrency "$LEVELS" \
        --out "$OUT/$STAMP-$1-short.json" --chart "$WORK/$1-short.png" || STATUS=1
    "$PY" bench/serve.py "${args[@]}" --prompts long,shared-prefix --concurrency 1 \
        --requests "$LONG_REQUESTS" \
        --long-tokens "$LONG_TOKENS" --out "$OUT/$STAMP-$1-long.json" \
        --chart "$WORK/$1-long.png" || STATUS=1
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "compare.sh: $1 died during the benchmark; the end of its log:" >&2
        tail -n 30 "$WORK/$1.log" >&2
        STATUS=1
    fi
}

# llama.cpp's server, optionally with its model loaded without extra buffer types.
NO_REPACK='import runpy, llama_cpp.llama_cpp as C
default = C.llama_model_default_params
def no_repack():
    p = default(); p.use_extra_bufts = False; return p
C.llama_model_default_params = no_repack
runpy.run_module("llama_cpp.server", run_name="__main__")'
LLAMA_SERVER=(-m llama_cpp.server)
[ "$LLAMA_CPP_NO_REPACK" = 1 ] && LLAMA_SERVER=(-c "$NO_REPACK")

KILN_LABELS=()
for dtype in $KILN_DTYPES; do
    label=kiln
    [ "$dtype" = float32 ] || label=kiln-${dtype/bfloat16/bf16}
    KILN_LABELS+=("$label")
    PORT=$(free_port)
    start "$label" /health .venv/bin/kiln serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
        --ctx-len "$CTX" --dtype "$dtype"
    bench "$label"
    stop_server
done

PORT=$(free_port)
start llamacpp /v1/models "$LLAMA_CPP_PY" "${LLAMA_SERVER[@]}" --model "$GGUF" \
    --model_alias "$MODEL" --n_ctx "$CTX" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
    --interrupt_requests False --host 127.0.0.1 --port "$PORT"
bench llamacpp
stop_server

echo "kiln vs llama.cpp: $MODEL, ctx $CTX, $THREADS threads, max_tokens $MAX_TOKENS," \
     "long prompts $LONG_TOKENS words, llama.cpp no-repack $LLAMA_CPP_NO_REPACK," \
     "kiln --dtype: $KILN_DTYPES" | tee "$OUT/$STAMP-compare.txt"
FILES=()
for label in "${KILN_LABELS[@]}"; do
    PAIR=("$OUT/$STAMP-$label"-{short,long}.json "$OUT/$STAMP"-llamacpp-{short,long}.json)
    "$PY" bench/serve.py --compare "${PAIR[@]}" | tee -a "$OUT/$STAMP-compare.txt"
    FILES+=("$OUT/$STAMP-$label"-{short,long}.json)
done
FILES+=("$OUT/$STAMP"-llamacpp-{short,long}.json)
"$PY" bench/serve.py --plot "${FILES[@]}" --chart "$OUT/$STAMP-compare.png"
echo "$OUT/$STAMP-compare.png"
exit $STATUS
