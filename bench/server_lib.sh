# Sourced by bench/compare.sh, cluster.sh and spec.sh: one server at a time in $SERVER_PID, a
# scratch dir in $WORK, both cleaned up on exit. Set PY first.
WORK=$(mktemp -d)
SERVER_PID=""

# SIGINT (a graceful stop: kiln drains, llama-server exits), then SIGKILL after STOP_WAIT_S.
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill -INT "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 $((${STOP_WAIT_S:-30} * 4))); do
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.25
    done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap 'stop_server; rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

# wait_ready LABEL URL PID LOG: until URL answers 200 (the model is loaded); if the server
# dies or START_TIMEOUT passes first, the end of LOG and exit 1.
wait_ready() {
    local label=$1 url=$2 pid=$3 log=$4 deadline=$((SECONDS + START_TIMEOUT))
    until curl -sf -o /dev/null "$url"; do
        if ! kill -0 "$pid" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
            echo "$(basename "$0"): $label did not become ready at $url:" >&2
            tail -n 30 "$log" >&2
            exit 1
        fi
        sleep 0.5
    done
    echo "[$(basename "$0" .sh)]  $label ready at $url" >&2
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
