#!/usr/bin/env bash
# One prepared GPU check (about 8 minutes on one H200): kernel correctness against the torch
# references on CUDA, then the kernel benches, then a short end-to-end serving bench.
# Run from the repository root on a machine with CUDA and the venv installed (make install).
set -uo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

echo "== correctness: kernels on CUDA vs references"
timeout 240 "$PY" -m pytest -q -k cuda tests/test_attention_kernel.py \
    tests/test_kv_cache_kernel.py tests/test_sampling_kernel.py 2>&1 | tail -n 15

echo "== kernel benches"
timeout 180 "$PY" -m pytest -q bench/bench_attention.py bench/bench_sampling.py \
    --benchmark-enable --benchmark-columns=mean,median,ops \
    --benchmark-json="$OUT/gpu-kernels.json" 2>&1 | tail -n 40

echo "== end to end: kiln serve on CUDA"
PORT=52711
"$PY" -m api.cli serve smollm2:135m --port $PORT > "$OUT/gpu-serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
timeout 150 "$PY" bench/serve.py --base-url "http://127.0.0.1:$PORT/v1" --label kiln-h200 \
    --prompts short,long --concurrency 1,16,64 --max-tokens 64 --quiet \
    --out "$OUT/gpu-serve.json" 2>&1 | tail -n 30
kill $SERVER; wait $SERVER 2>/dev/null
tail -n 5 "$OUT/gpu-serve.log"
