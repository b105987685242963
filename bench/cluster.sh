#!/usr/bin/env bash
# kiln on Ray Serve: the same prompts against one engine (plain `kiln serve`), one replica
# (`--replicas 1`: the cluster's own overhead) and N replicas (`--replicas N`), each server in
# turn on a free loopback port; `kiln bench` against it, its routing counters (/health's
# cluster block) saved beside the results, the server stopped; then one table.
#
#   bench/cluster.sh                                        # the run of bench/README.md
#   LEVELS=1,4 REQUESTS=4 MAX_TOKENS=8 LONG_TOKENS=200 bench/cluster.sh    # a quick check
#
# Environment: MODEL (smollm2:135m)  CTX (2048)  REPLICAS (2)  KV_TOKENS (each engine's
#              --kv-cache-tokens; default the server's own)  LEVELS (1,4,16)
#              PROMPTS (short,prefixes: kiln bench's sets; `prefixes` cycles 4 long prefixes)
#              REQUESTS (per level; 0 = kiln bench's default)  MAX_TOKENS (32)
#              LONG_TOKENS (words of each prefix, 500)  WARMUP (2)  OUT (bench/results)
#              START_TIMEOUT (600 s)
# Writes OUT/STAMP-cluster-{engine,replicas1,replicasN}.json (kiln bench's results, with the
# routing counters under "routing") and OUT/STAMP-cluster.txt (the table).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
MODEL=${MODEL:-smollm2:135m}
CTX=${CTX:-2048}
REPLICAS=${REPLICAS:-2}
KV_TOKENS=${KV_TOKENS:-}
LEVELS=${LEVELS:-1,4,16}
PROMPTS=${PROMPTS:-short,prefixes}
REQUESTS=${REQUESTS:-0}
MAX_TOKENS=${MAX_TOKENS:-32}
LONG_TOKENS=${LONG_TOKENS:-500}
WARMUP=${WARMUP:-2}
OUT=${OUT:-bench/results}
START_TIMEOUT=${START_TIMEOUT:-600}
STAMP=$(date -u +%Y%m%d-%H%M%S)
STOP_WAIT_S=30
source "$(dirname "$0")/server_lib.sh"
mkdir -p "$OUT"

# run LABEL [kiln serve flags...]: start, benchmark, save the routing counters, stop.
run() {
    local label=$1 log="$WORK/$1.log" out="$OUT/$STAMP-cluster-$1.json"
    shift
    PORT=$(free_port)
    local kv=()
    [ -n "$KV_TOKENS" ] && kv=(--kv-cache-tokens "$KV_TOKENS")
    .venv/bin/kiln serve "$MODEL" --host 127.0.0.1 --port "$PORT" --ctx-len "$CTX" \
        "${kv[@]}" "$@" >>"$log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$label" "http://127.0.0.1:$PORT/health" "$SERVER_PID" "$log"
    .venv/bin/kiln bench --base-url "http://127.0.0.1:$PORT/v1" --label "$label" \
        --model "$MODEL" --prompts "$PROMPTS" --concurrency "$LEVELS" --requests "$REQUESTS" \
        --max-tokens "$MAX_TOKENS" --long-tokens "$LONG_TOKENS" --warmup "$WARMUP" \
        --out "$out" --chart "$WORK/$label.png" --quiet
    curl -sf "http://127.0.0.1:$PORT/health" >"$WORK/$label.health.json"
    "$PY" - "$out" "$WORK/$label.health.json" <<'EOF'
import json, sys
path, health = sys.argv[1], json.load(open(sys.argv[2]))
doc = json.load(open(path))
doc["routing"] = health.get("cluster", {}).get("routing")
json.dump(doc, open(path, "w"), indent=1)
EOF
    stop_server
}

run engine
run replicas1 --replicas 1
run "replicas$REPLICAS" --replicas "$REPLICAS"

"$PY" - "$OUT/$STAMP-cluster" "$REPLICAS" <<'EOF' | tee "$OUT/$STAMP-cluster.txt"
import json, sys
stem, n = sys.argv[1], sys.argv[2]
labels = ["engine", "replicas1", f"replicas{n}"]
docs = {k: json.load(open(f"{stem}-{k}.json")) for k in labels}
print(f"| prompt set, concurrency | {' | '.join(labels)} | {labels[2]} / {labels[0]} |")
print("|---" * (len(labels) + 2) + "|")
first = docs[labels[0]]["levels"]
for i, lv in enumerate(first):
    row = [docs[k]["levels"][i] for k in labels]
    tps = [r["output_throughput"] for r in row]
    ttft = [r["ttft"]["p50"] for r in row]
    cells = [f"{t:.1f} tok/s, TTFT {f:.3f} s" for t, f in zip(tps, ttft)]
    print(f"| {lv['prompt_set']}, {lv['concurrency']} | {' | '.join(cells)} | "
          f"{tps[2] / tps[0]:.2f}x |")
for k in labels[1:]:
    r = docs[k].get("routing") or {}
    print(f"{k}: routed {r.get('requests_routed')}, prefix hits {r.get('prefix_hits')} "
          f"(hit rate {r.get('hit_rate')}), hit tokens {r.get('hit_tokens')} of "
          f"{r.get('prompt_tokens')} prompt tokens (token hit rate {r.get('token_hit_rate')}), "
          f"by replica {r.get('by_replica')}")
EOF
