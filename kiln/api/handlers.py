"""The two generation endpoints. Everything that can be rejected is checked before the
engine sees the request (and before a stream starts); then outputs flow one way: engine ->
OutputAssembler -> response body or SSE chunks."""

from __future__ import annotations

import time

from kiln.api.chat import collect, prepare_chat, submit
from kiln.api.generation import OutputAssembler
from kiln.api.protocol import load_json_body, parse_chat_request, parse_completion_request
from kiln.api.responses import completion_logprobs, system_fingerprint, usage
from kiln.api.state import ServerState
from kiln.api.streaming import json_response, send_sse
from kiln.api.tools import tool_call_json
from kiln.runtime.errors import InvalidRequestError


async def chat_completions(request):
    state: ServerState = request.app.ctx.state
    req = parse_chat_request(load_json_body(request.body))
    job = await prepare_chat(state, req)
    gen = job.submit(state)
    created, model = int(time.time()), state.loaded.name
    if req.stream:
        return await _stream_chat(request, gen, req, created, model)
    result = await collect(gen)
    calls = result.tool_calls
    message = {"role": "assistant",
               "content": result.content if (result.content or not calls) else None}
    if calls:
        message["tool_calls"] = [tool_call_json(c) for c in calls]
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    body = {
        "id": gen.request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message,
                     "logprobs": {"content": result.logprobs} if req.logprobs else None,
                     "finish_reason": result.finish_reason}],
        "usage": usage(gen.assembler.totals, state.config.ctx_len),
    }
    return json_response(body)


async def _stream_chat(request, gen, req, created: int, model: str):
    fingerprint = system_fingerprint()

    def chunk(delta: dict, finish=None, logprobs=None) -> dict:
        c = {"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "system_fingerprint": fingerprint,
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish}]}
        if req.include_usage:
            c["usage"] = None
        return c

    async def events():
        yield chunk({"role": "assistant", "content": ""})
        async for d in gen.deltas():
            lp = {"content": d.logprobs} if req.logprobs and d.logprobs else None
            if d.reasoning:
                yield chunk({"reasoning_content": d.reasoning})
            if d.content or lp:
                yield chunk({"content": d.content}, logprobs=lp)
            if d.tool_calls:
                yield chunk({"tool_calls": [t.to_json() for t in d.tool_calls]})
            if d.finish_reason:
                yield chunk({}, finish=d.finish_reason)
        if req.include_usage:
            u = chunk({})
            u["choices"], u["usage"] = [], usage(gen.assembler.totals, gen.state.config.ctx_len)
            yield u

    return await send_sse(request, events())


async def completions(request):
    state: ServerState = request.app.ctx.state
    req = parse_completion_request(load_json_body(request.body))
    await state.ensure_model(req.model)
    loaded = state.loaded
    tok = loaded.tokenizer
    if isinstance(req.prompt, str):
        ids, prompt_text = tok.encode(req.prompt, add_special_tokens=True), req.prompt
    else:
        ids = list(req.prompt)
        if max(ids) >= tok.vocab_size:
            raise InvalidRequestError(f"Token id {max(ids)} is outside the vocabulary "
                                      f"(size {tok.vocab_size}).", param="prompt")
        prompt_text = tok.decode(ids)
    if not ids:
        raise InvalidRequestError("The prompt is empty.", param="prompt")
    want_logprobs = req.logprobs is not None
    assembler = OutputAssembler(tok, stop=list(req.stop),
                                logprobs_style="completions" if want_logprobs else None)
    gen = submit(state, "cmpl", ids, req, assembler=assembler,
                  num_top=req.logprobs if want_logprobs else None)
    created, model = int(time.time()), loaded.name
    echo = prompt_text if req.echo else ""

    def choice(text: str, entries: list[dict], finish, offset: int) -> dict:
        return {"index": 0, "text": text, "finish_reason": finish,
                "logprobs": completion_logprobs(entries, offset) if want_logprobs else None}

    if req.stream:
        fingerprint = system_fingerprint()

        async def events():
            offset = len(echo)
            if echo:
                yield _cmpl_chunk(gen, created, model, fingerprint, req,
                                  choice(echo, [], None, 0))
            async for d in gen.deltas():
                if d.content or d.logprobs or d.finish_reason:
                    yield _cmpl_chunk(gen, created, model, fingerprint, req,
                                      choice(d.content, d.logprobs, d.finish_reason, offset))
                    offset += len(d.content)
            if req.include_usage:
                u = _cmpl_chunk(gen, created, model, fingerprint, req, None)
                u["usage"] = usage(assembler.totals, state.config.ctx_len)
                yield u

        return await send_sse(request, events())
    text, entries, finish = [], [], None
    async for d in gen.deltas():
        text.append(d.content)
        entries += d.logprobs
        finish = d.finish_reason or finish
    body = {"id": gen.request_id, "object": "text_completion", "created": created,
            "model": model, "choices": [choice(echo + "".join(text), entries, finish,
                                               len(echo))],
            "usage": usage(assembler.totals, state.config.ctx_len)}
    return json_response(body)


def _cmpl_chunk(gen, created, model, fingerprint, req, choice) -> dict:
    c = {"id": gen.request_id, "object": "text_completion", "created": created,
         "model": model, "system_fingerprint": fingerprint,
         "choices": [choice] if choice else []}
    if req.include_usage:
        c["usage"] = None
    return c
