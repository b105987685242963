#!/usr/bin/env bash
# The one prepared GPU check (about 5 minutes on one H200; every figure on one line): the
# kernels' CUDA tests, then bench/gpu_check.py, whose sections each report a failure and go on.
# On the GPU machine, from the repository root, with bench/wheels carried (64 MiB at most;
# bench/fetch_wheels.sh fills it):
#     bash bench/gpu_check.sh
# It runs under that machine's own python3 (torch and Triton, no network): the few pure or
# small packages kiln imports besides are installed from bench/wheels into a scratch
# directory, never into that python. Here, on a CPU:
#     bash bench/gpu_check.sh --dry-run     (the same steps at toy sizes, in the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ "${1:-}" = "--dry-run" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export TRITON_DEFAULT_FP_FUSION=1  # Triton 3.9's default, said out loud (no warning)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader

# What kiln needs that this python lacks, from the carried wheels (pip picks the version;
# bench/fetch_wheels.sh says what the image already has).
missing=$("$PY" - <<'PY'
import importlib.util as u
mods = {"gguf": "gguf", "sanic": "sanic", "sanic_routing": "sanic-routing",
        "html5tagger": "html5tagger", "tracerite": "tracerite", "websockets": "websockets",
        "httptools": "httptools", "ujson": "ujson"}
print(" ".join(pkg for mod, pkg in mods.items() if u.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
    DEPS=$(mktemp -d)
    echo "installing from bench/wheels into $DEPS: $missing"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
        --find-links bench/wheels --target "$DEPS" $missing || exit 1
    export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
if [ "${1:-}" != "--dry-run" ]; then
    # The kernels' own tests, at their CUDA parameters (the CPU runs them in the interpreter).
    timeout "${KERNEL_TESTS_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -k cuda \
        tests/test_attention_kernel.py tests/test_kv_cache_kernel.py \
        tests/test_sampling_kernel.py 2>&1 | tail -n 25 || status=1
fi
# The check itself inside what is left of the 600 s a device command may run.
timeout "${CHECK_S:-420}" "$PY" bench/gpu_check.py "$@" || status=1
exit $status
