"""qwen2.5-coder:0.5b, the catalogue's Qwen2 model (a Q4_K_M mix: Q5_0, Q8_0, Q4_K, Q6_K and F32
tensors): its file, its defaults, its logits and greedy tokens against transformers on the same
GGUF (tests/golden, from `tests/make_golden.py --model qwen2.5-coder:0.5b`), and tool calls
through its own chat template (which renders `tools` itself and writes calls as
`<tool_call>{...}</tool_call>`) with the OpenAI SDK."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import jsonschema
import numpy as np
import pytest
import torch
from api_server import KilnServer
from paged import PagedSequence

from kiln.runtime.backends.cpu.backend import CpuBackend
from kiln.runtime.models import llama
from kiln.runtime.store.catalogue import lookup
from kiln.runtime.store.gguf_file import open_gguf
from kiln.runtime.store.pull import ensure_model

TAG = "qwen2.5-coder:0.5b"
GOLDEN = Path(__file__).parent / "golden"
LOGITS_ATOL = 2e-3
LOGPROB_ATOL = 1e-3
NUM_DECODE_STEPS = 8

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def path() -> Path:
    return ensure_model(TAG)


@pytest.fixture(scope="module")
def gf(path):
    return open_gguf(path)


@pytest.fixture(scope="module")
def model(gf):
    return llama.build(llama.read_config(gf), gf, CpuBackend())


@pytest.fixture(scope="module")
def golden(path):
    return (json.loads((GOLDEN / f"{path.stem}.json").read_text()),
            np.load(GOLDEN / f"{path.stem}.npz"))


def test_pulled_file_is_the_catalogue_gguf(path):
    entry = lookup(TAG)
    assert path.stat().st_size == entry.size == 491_400_064
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    assert h.hexdigest() == entry.sha256


def test_config_and_tensor_types(gf):
    cfg = llama.read_config(gf)
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size) == ("qwen2", 24, 14, 2, 64, 151936)
    types = {t.tensor_type.name for t in gf.reader.tensors}
    assert types == {"Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32"}
    assert gf.has("blk.0.attn_q.bias")


def test_defaults_are_qwen_generation_config():
    d = lookup(TAG).defaults
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty) == \
        (0.7, 0.8, 20, 0.0, 1.1)


@pytest.mark.parametrize("case", [0, 1, 2, 3])
def test_logits_and_greedy_decode_match_transformers(model, golden, case):
    cases, arrays = golden
    c = cases[case]
    seq = PagedSequence(model)
    logits = seq.feed(c["prompt_ids"])
    ref = torch.from_numpy(arrays[f"logits_{case}"])
    diff = (logits - ref).abs().max().item()
    assert diff < LOGITS_ATOL, f"max abs diff {diff}"
    for step, (token, logprob) in enumerate(
            list(zip(c["greedy_ids"], c["greedy_logprobs"], strict=True))[:NUM_DECODE_STEPS]):
        assert int(logits.argmax()) == token, f"greedy step {step}"
        assert abs(torch.log_softmax(logits, -1)[token].item() - logprob) < LOGPROB_ATOL
        logits = seq.feed([token])


# --- through the server: tools with the model's own template ---------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, path):
    with KilnServer(tmp_path_factory.mktemp("kiln"), "--ctx-len", "2048", model=TAG) as s:
        yield s


def _check(calls, names):
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function",
                                                         "function": {"name": "get_time"}}],
                         ids=["auto", "required", "named"])
def test_tool_calls_through_the_sdk_streamed_and_not(server, choice):
    client = server.client()
    kw = dict(model=TAG, temperature=0, max_tokens=80, tools=[WEATHER, TIME], tool_choice=choice,
              messages=[{"role": "user", "content": "What's the weather in Paris right now?"}])
    r = client.chat.completions.create(**kw)
    names = {"get_time"} if isinstance(choice, dict) else {"get_weather", "get_time"}
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message.content
    whole = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    _check(whole, names)
    streamed: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
            for d in chunk.choices[0].delta.tool_calls or []:
                c = streamed.setdefault(d.index, ["", ""])
                c[0] += d.function.name or ""
                c[1] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in streamed.values()] == \
        [(n, json.loads(a)) for n, a in whole]


def test_models_route_shows_qwen_defaults(server):
    models = {m["id"]: m for m in server.client().models.list().model_dump()["data"]}
    d = models[TAG]["defaults"]
    assert (d["temperature"], d["top_p"], d["top_k"], d["repetition_penalty"]) == \
        (0.7, 0.8, 20, 1.1)


def test_gguf_is_a_q4_k_m_mix(gf):
    assert gf.field("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
