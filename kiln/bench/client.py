"""The HTTP side: one streaming chat completion, timed chunk by chunk, and the probe that asks
once whether the server takes `ignore_eos`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from kiln.bench.results import RequestResult


class BenchError(Exception):
    """The server cannot be benchmarked as asked (unreachable, or refusing a plain request)."""


@dataclass(frozen=True)
class IgnoreEos:
    """Whether every request carries `ignore_eos: true`, and why (shown and recorded)."""

    sent: bool
    note: str


def open_client(base_url: str, api_key: str, max_connections: int, timeout: float
                ) -> httpx.AsyncClient:
    # A connection per request: llama-server closes idle keep-alive connections, and a request
    # sent on one as it closes fails with no response; a loopback connect costs ~0.1 ms.
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout,
                             headers={"Authorization": f"Bearer {api_key}"})


async def probe_ignore_eos(client: httpx.AsyncClient, model: str) -> IgnoreEos:
    """A 1-token request with `ignore_eos`; on a 4xx the same without it tells a server that
    refuses the field (OpenAI's own API) from a request refused for another reason."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with_field = await _post(client, {**body, "ignore_eos": True})
    if with_field.status_code == 200:
        return IgnoreEos(True, "ignore_eos sent: every reply runs to max_tokens")
    if 400 <= with_field.status_code < 500:
        plain = await _post(client, body)
        if plain.status_code == 200:
            return IgnoreEos(False, f"the server refused ignore_eos (HTTP "
                                    f"{with_field.status_code}: {_message(with_field)}): replies "
                                    "end where the model stops, so their lengths differ "
                                    "between servers")
        with_field = plain
    raise BenchError(f"a 1-token chat request to {client.base_url} failed: HTTP "
                     f"{with_field.status_code}: {_message(with_field)}")


async def served_model(client: httpx.AsyncClient) -> str:
    """The model GET /models lists as loaded (kiln's cards say), else the first: what to ask
    for when no --model is given."""
    try:
        resp = await client.get("/models")
        models = resp.json()["data"] if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"no --model given, and {client.base_url}/models did not list the "
                         f"served models ({type(exc).__name__}: {exc})") from exc
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise BenchError(f"no --model given, and {client.base_url}/models listed none "
                         f"(HTTP {resp.status_code}): name one with --model")
    return next((m["id"] for m in models if m.get("loaded") is True), models[0]["id"])


async def _post(client: httpx.AsyncClient, body: dict) -> httpx.Response:
    try:
        return await client.post("/chat/completions", json=body)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {client.base_url}: {type(exc).__name__}: {exc}") from exc


def _message(resp: httpx.Response) -> str:
    try:
        error = resp.json().get("error")
        text = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        text = None
    return str(text or resp.text)[:300]


async def run_request(client: httpx.AsyncClient, body: dict) -> RequestResult:
    """One streamed chat completion; a failure is recorded in the result, never raised."""
    res, usage, last = RequestResult(), None, 0.0
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                choice = (chunk.get("choices") or [{}])[0]
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
                delta = choice.get("delta") or {}
                if not (delta.get("content") or delta.get("reasoning_content")):
                    if choice.get("finish_reason") and res.content_chunks == 0:
                        # The reply ended before any text (a stop token first): the prompt
                        # was still read, so the end marks the first token's time.
                        res.ttft = time.perf_counter() - t0
                    continue
                now = time.perf_counter() - t0
                if res.content_chunks == 0:
                    res.ttft = now
                else:
                    res.itl.append(now - last)
                last, res.content_chunks = now, res.content_chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e = time.perf_counter() - t0
    if res.content_chunks == 0 and res.ttft == 0.0 and res.error is None:
        res.error = "no content in the response"
    usage = usage or {}
    res.output_tokens = usage.get("completion_tokens") or res.content_chunks
    res.prompt_tokens = usage.get("prompt_tokens") or 0
    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return res
