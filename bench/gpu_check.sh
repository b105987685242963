#!/usr/bin/env bash
# The one prepared GPU check (about 5 minutes on one H200; every figure on one line).
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

# What kiln needs that this python lacks, from the carried wheels (pip picks the version).
missing=$("$PY" - <<'PY'
import importlib.util as u
mods = {"gguf": "gguf", "yaml": "pyyaml", "tokenizers": "tokenizers", "xxhash": "xxhash",
        "tqdm": "tqdm", "jinja2": "jinja2", "markupsafe": "markupsafe", "numpy": "numpy"}
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
# 560 s: inside the 600 s a device command may run, the whole check included.
timeout 560 "$PY" bench/gpu_check.py "$@"
