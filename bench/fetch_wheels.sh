#!/usr/bin/env bash
# What bench/gpu_check.sh needs on the GPU machine that its image lacks. That machine has its
# own python3 (3.12) with torch, Triton, numpy, tokenizers, jinja2, pyyaml, xxhash, tqdm,
# httpx, uvloop, aiofiles and multidict, but no network: gguf and the Sanic stack travel as
# wheels in bench/wheels (ignored by git; a few MB of the 64 MiB a device run may carry), with
# the default model's tokenizer as a tensorless GGUF, so the check can serve a random-weight
# model of the default model's shapes over HTTP.
#   bash bench/fetch_wheels.sh && run: bash bench/gpu_check.sh  (carry: bench/wheels)
set -euo pipefail
DEST=${DEST:-bench/wheels}
PY=${PY:-.venv/bin/python}
mkdir -p "$DEST"
get() { $PY -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
          --platform manylinux_2_28_x86_64 --dest "$DEST" "$@"; }
# Pure Python: one wheel serves every version.
get --python-version 3.12 gguf==0.19.0 sanic==25.12.1 sanic-routing html5tagger tracerite
# Compiled, per CPython version (pip there picks its own).
for v in 3.11 3.12 3.13; do
    get --python-version "$v" websockets httptools ujson
done
$PY - "$DEST/smollm2-tokenizer.gguf" <<'PY'
import sys

import gguf

from kiln.runtime.store.pull import ensure_model

reader = gguf.GGUFReader(str(ensure_model("smollm2:135m")))
writer = gguf.GGUFWriter(sys.argv[1], "llama")
for key, field in reader.fields.items():
    if key.startswith("tokenizer."):
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.close()
PY
du -sh "$DEST"
