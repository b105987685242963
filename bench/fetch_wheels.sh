#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on the GPU machine, which has its own python3 with
# torch and Triton but no network and none of kiln's other dependencies. They go in
# bench/wheels (ignored by git, about 55 MB: under the 64 MiB a device run may carry), one
# set per CPython 3.10-3.13 where a package is built per version; pip there picks its own.
#   bash bench/fetch_wheels.sh && run: bash bench/gpu_check.sh  (carry: bench/wheels)
set -euo pipefail
DEST=${DEST:-bench/wheels}
PIP=${PIP:-.venv/bin/python -m pip}
mkdir -p "$DEST"
get() { $PIP download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
          --platform manylinux_2_28_x86_64 --dest "$DEST" "$@"; }
# Pure Python, or one abi3 wheel for every version.
get --python-version 3.11 gguf==0.19.0 jinja2 tqdm tokenizers==0.23.3
for v in 3.10 3.11 3.12 3.13; do
    get --python-version "$v" pyyaml xxhash markupsafe
done
# numpy comes with most torch installs; 16 MB a version, so only the recent three.
for v in 3.11 3.12 3.13; do get --python-version "$v" numpy; done
du -sh "$DEST"
