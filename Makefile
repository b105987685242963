# The two set-up commands of the README: `make serve` and `make test`.
# Both create .venv and install kiln into it; a second run reuses it.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PIP     := $(PY) -m pip install --quiet --disable-pip-version-check
MODEL   ?= smollm2:135m
HOST    ?= 127.0.0.1
PORT    ?= 52625

# tests/test_webui.py drives the chat page in Debian's chromium (Playwright cannot download its
# own browser everywhere). As root on Debian/Ubuntu it is installed when missing; otherwise
# install it yourself (README, "The chat page"), or the browser tests are skipped.
CHROMIUM := command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] \
	&& command -v apt-get >/dev/null 2>&1 \
	&& { apt-get install -y --no-install-recommends chromium >/dev/null \
	|| { apt-get update >/dev/null && apt-get install -y --no-install-recommends chromium \
	>/dev/null; }; }; } || echo "chromium not installed: the browser tests will be skipped"

.PHONY: install test serve run lint bench clean

install: $(STAMP)

# On a machine without an NVIDIA GPU, install the CPU build of torch first: a plain
# `torch` requirement would otherwise pull the multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if ! nvidia-smi >/dev/null 2>&1; then $(PIP) torch==2.13.0 2>&1 | grep -v 'is ignored' || true; fi
	$(PIP) -e '.[dev,cluster]' 2>&1 | grep -v 'is ignored' || true
	$(PY) -c 'import torch, triton, sanic, gguf, tokenizers, xgrammar, ray.serve'
	$(CHROMIUM)
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/kiln pull $(MODEL)
	$(PY) -m pytest -q --durations=15 tests

serve: $(STAMP)
	$(VENV)/bin/kiln pull $(MODEL)
	$(VENV)/bin/kiln serve $(MODEL) --host $(HOST) --port $(PORT)

run: $(STAMP)
	$(VENV)/bin/kiln run $(MODEL) "$(PROMPT)"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m pytest -q bench --benchmark-enable

clean:
	rm -rf $(VENV) *.egg-info
