# Sourced by bench/compare.sh and bench/cluster.sh: one server at a time in $SERVER_PID, a
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

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
