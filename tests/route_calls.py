"""One call to every route family, and what of its answer must not depend on the engine behind
the API (one engine in the server, or Ray Serve replicas): test_cluster_serve.py sends each to
both and compares.

Every generation is greedy or seeded with all its sampling fields sent (the sticky settings
other tests leave behind must not matter), so on the CPU kernels its bits are the same on any
engine, alone or batched. What differs by design is left out: ids, times, the KV pool's size
(each replica has its own), counters.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from api_server import MODEL
from prometheus_client.parser import text_string_to_metric_families

# Every sampling field: nothing left to the sticky settings.
GREEDY = {"temperature": 0, "top_p": 1, "top_k": 40, "min_p": 0, "presence_penalty": 0,
          "frequency_penalty": 0, "repetition_penalty": 1.0, "repeat_last_n": 64}
SEEDED = {**GREEDY, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
OLLAMA_GREEDY = {"temperature": 0, "top_p": 1, "top_k": 40, "min_p": 0, "presence_penalty": 0,
                 "frequency_penalty": 0, "repeat_penalty": 1.0, "repeat_last_n": 64}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"]}


class RouteCall(NamedTuple):
    name: str
    method: str
    path: str
    body: dict | None = None


def _stream(body: dict) -> dict:
    return {**body, "stream": True}


CHAT = {"model": MODEL, "messages": ASK, "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
        **SEEDED}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
              "echo": True, "logprobs": 2, "n": 2, **SEEDED}
RESPONSE = {"model": MODEL, "input": "What is the capital of France?",
            "max_output_tokens": 8, **GREEDY}
OLLAMA_CHAT = {"model": MODEL, "messages": ASK, "stream": False,
               "options": {**OLLAMA_GREEDY, "num_predict": 8}}
CALLS = [
    RouteCall("chat", "POST", "/v1/chat/completions", CHAT),
    RouteCall("chat-stream", "POST", "/v1/chat/completions",
              _stream({**CHAT, "stream_options": {"include_usage": True}})),
    RouteCall("chat-n2-tools", "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 40, "n": 2, "tools": [WEATHER], "tool_choice": "required", **SEEDED}),
    RouteCall("chat-json-schema", "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Name a city as JSON."}],
        "max_tokens": 30, "response_format": {"type": "json_schema", "json_schema": {
            "name": "c", "schema": CITY}}, **GREEDY}),
    RouteCall("completions", "POST", "/v1/completions", COMPLETION),
    RouteCall("completions-stream", "POST", "/v1/completions", _stream(COMPLETION)),
    RouteCall("responses", "POST", "/v1/responses", RESPONSE),
    RouteCall("responses-stream", "POST", "/v1/responses", _stream(RESPONSE)),
    RouteCall("ollama-chat", "POST", "/api/chat", OLLAMA_CHAT),
    RouteCall("ollama-chat-stream", "POST", "/api/chat", {**OLLAMA_CHAT, "stream": True}),
    RouteCall("ollama-generate", "POST", "/api/generate", {
        "model": MODEL, "prompt": "Why is the sky blue?", "stream": False,
        "options": {**OLLAMA_GREEDY, "num_predict": 8}}),
    RouteCall("ollama-generate-raw", "POST", "/api/generate", {
        "model": MODEL, "prompt": "The capital of France is", "raw": True, "stream": True,
        "format": "json", "options": {**OLLAMA_GREEDY, "num_predict": 8}}),
    RouteCall("ollama-ps", "GET", "/api/ps"),
    RouteCall("ollama-show", "POST", "/api/show", {"model": MODEL}),
    RouteCall("ollama-tags", "GET", "/api/tags"),
    RouteCall("ollama-version", "GET", "/api/version"),
    RouteCall("tokenize", "POST", "/tokenize", {"model": MODEL, "messages": ASK,
                                               "return_token_strs": True}),
    RouteCall("detokenize", "POST", "/detokenize", {"model": MODEL, "tokens": [504, 3575, 282]}),
    RouteCall("tokenizer-info", "GET", "/tokenizer_info"),
    RouteCall("models", "GET", "/v1/models"),
    RouteCall("model", "GET", f"/v1/models/{MODEL}"),
    RouteCall("metrics", "GET", "/metrics"),
    RouteCall("health", "GET", "/health"),
]


# --- what must agree ---

def _events(text: str) -> list[dict]:
    """The JSON events of an SSE or NDJSON body ([DONE] and event lines left out)."""
    lines = [line.removeprefix("data: ") for line in text.splitlines()]
    return [json.loads(line) for line in lines
            if line.strip() and not line.startswith("event:") and line != "[DONE]"]


def _chat(body: dict) -> list:
    return [(c["message"], c["logprobs"], c["finish_reason"]) for c in body["choices"]]


def _by_choice(parts: list[tuple]) -> dict:
    """A stream's chunks per choice, in order: choices interleave as they are produced."""
    choices: dict = {}
    for index, *rest in parts:
        choices.setdefault(index, []).append(tuple(rest))
    return choices


def _chat_stream(events: list[dict]) -> tuple:
    parts = [(c["index"], c["delta"], c["logprobs"], c["finish_reason"])
             for e in events for c in e["choices"]]
    usage = events[-1]["usage"]
    return _by_choice(parts), (usage["prompt_tokens"], usage["completion_tokens"])


def _calls(body: dict) -> list:
    """Tool calls without their random ids."""
    return [[(t["function"]["name"], t["function"]["arguments"])
             for t in c["message"].get("tool_calls") or []] for c in body["choices"]]


def _completion(body: dict) -> list:
    return [(c["text"], c["logprobs"], c["finish_reason"]) for c in body["choices"]]


def _response(body: dict) -> tuple:
    return body["status"], [(o["type"], o.get("content")) for o in body["output"]]


def _response_stream(events: list[dict]) -> tuple:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return [e["type"] for e in events], _response(events[-1]["response"])


def _ollama(body: dict) -> tuple:
    return (body.get("message") or body.get("response"), body["done_reason"],
            body["prompt_eval_count"], body["eval_count"])


def _ollama_stream(events: list[dict]) -> tuple:
    assert events[-1]["done"]
    return [e.get("message") or e.get("response") for e in events[:-1]], _ollama(events[-1])


def _models(body: dict) -> list:
    return [(m["id"], m["context_length"], m["loaded"], m["defaults"]) for m in body["data"]]


def _metrics(text: str) -> set:
    return {f.name for f in text_string_to_metric_families(text) if f.name.startswith("kiln:")
            and not f.name.startswith("kiln:cluster_")}


def _health(body: dict) -> tuple:
    return body["status"], body["model"], body["kv_total_blocks"] > 0


AGREE = {
    "chat": _chat, "chat-stream": _chat_stream, "chat-n2-tools": _calls,
    "chat-json-schema": _chat, "completions": _completion,
    "completions-stream": lambda events: _by_choice(
        [(c["index"], c["text"], c["logprobs"], c["finish_reason"])
         for e in events for c in e["choices"]]),
    "responses": _response, "responses-stream": _response_stream,
    "ollama-chat": _ollama, "ollama-chat-stream": _ollama_stream,
    "ollama-generate": _ollama, "ollama-generate-raw": _ollama_stream,
    "ollama-ps": lambda b: [(m["name"], m["context_length"]) for m in b["models"]],
    "ollama-show": lambda b: {k: v for k, v in b.items() if k != "modified_at"},
    "ollama-tags": lambda b: sorted(m["name"] for m in b["models"]),
    "ollama-version": lambda b: b, "tokenize": lambda b: b, "detokenize": lambda b: b,
    "tokenizer-info": lambda b: b,
    "models": _models, "model": lambda b: _models({"data": [b]}),
    "metrics": _metrics, "health": _health,
}
STREAMED = {"chat-stream", "completions-stream", "responses-stream", "ollama-chat-stream",
            "ollama-generate-raw"}


def comparable(call: RouteCall, text: str):
    """What of the answer must be the same on any engine."""
    if call.name == "metrics":
        return _metrics(text)
    return AGREE[call.name](_events(text) if call.name in STREAMED else json.loads(text))
