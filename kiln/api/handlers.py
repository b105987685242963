"""The two generation endpoints. Everything that can be rejected is checked before the
engine sees the request (and before a stream starts); then outputs flow one way: engine ->
OutputAssembler -> response body or SSE chunks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kiln.api.continuation import continuation_prompt
from kiln.api.errors import InternalServerError, ServiceUnavailableError, error_body
from kiln.api.generation import Delta, OutputAssembler
from kiln.api.protocol import load_json_body, parse_chat_request, parse_completion_request
from kiln.api.reasoning import ReasoningStart
from kiln.api.responses import completion_logprobs, new_id, system_fingerprint, usage
from kiln.api.state import ServerState
from kiln.api.tools import (
    plan_tools,
    template_handles_tools,
    tool_call_json,
    tool_format_for,
    tool_messages,
)
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.text.chat_template import TemplateError


@dataclass
class Generation:
    """One admitted request: its engine stream and the assembler turning it into text."""

    request_id: str
    stream: object  # runtime.engine.RequestStream
    assembler: OutputAssembler
    state: ServerState

    async def deltas(self) -> AsyncIterator[Delta]:
        self.state.begin()
        try:
            async for out in self.stream:
                delta = self.assembler.add(out, time.monotonic())
                if out.finish_reason == "abort" and not self.assembler.stopped \
                        and not self.state.draining:  # shutdown ends a reply as "abort"
                    raise InternalServerError(self.request_id, "The engine aborted the request.")
                yield delta
                if self.assembler.stopped:  # the engine has ended it too, in the same step
                    if not out.finished:  # (a stop the engine's reading missed)
                        self.state.engine.abort(self.request_id, reason="stop string")
                    return
        finally:
            self.state.end()


def _think_kwargs(state: ServerState, sent) -> dict:
    current = state.settings.current
    think = sent.think if sent.think is not None else current.think
    effort = sent.reasoning_effort if sent.reasoning_effort is not None \
        else current.reasoning_effort
    kw = {}
    if think is not None:
        kw["enable_thinking"] = think
    if effort is not None:
        kw["reasoning_effort"] = effort
    return kw


def _submit(state: ServerState, prefix: str, ids: list[int], req, *, num_top: int | None,
            assembler: OutputAssembler, **engine_kw) -> Generation:
    if state.draining:
        raise ServiceUnavailableError()
    engine = state.engine
    engine.check_context(len(ids), req.max_tokens)  # before settings change
    sampling = state.settings.admit(req.sampling)
    request_id = new_id(prefix)
    stream = engine.add_request(request_id, ids, sampling, max_tokens=req.max_tokens,
                                num_top_logprobs=num_top, stop=list(req.stop), **engine_kw)
    return Generation(request_id, stream, assembler, state)


async def chat_completions(request):
    state: ServerState = request.app.ctx.state
    req = parse_chat_request(load_json_body(request.body))
    await state.ensure_model(req.model)
    loaded, engine = state.loaded, state.engine
    plan = plan_tools(req, tool_format_for(loaded.name))
    messages = [m.to_template() for m in req.messages]
    if template_handles_tools(loaded.chat_template.template_str):
        tools = [t.to_template() for t in plan.prompt_tools] or None
    else:  # the template ignores tools: describe them in the system message ourselves
        messages, tools = tool_messages(messages, plan.prompt_tools, plan.format), None
    kw = _think_kwargs(state, req.sampling)
    try:
        if req.continue_final_message:
            rendered = loaded.chat_template.render(messages, add_generation_prompt=False,
                                                   tools=tools, **kw)
            prompt = continuation_prompt(rendered, req.messages[-1].content or "")
        else:
            prompt = loaded.chat_template.render(messages, add_generation_prompt=True,
                                                 tools=tools, **kw)
    except TemplateError as exc:
        raise InvalidRequestError(f"The chat template rejected the messages: {exc}",
                                  param="messages") from exc
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    grammar = None
    if plan.grammar is not None:  # compiled off the event loop; a bad schema is a 400 here
        grammar = await asyncio.get_running_loop().run_in_executor(
            None, engine.compile_grammar, plan.grammar)
        if state.engine is not engine:
            raise InternalServerError(new_id("req"), "The model was switched meanwhile.")
    tags = loaded.reasoning_tags
    start = ReasoningStart.for_prompt(prompt, tags, continuing=req.continue_final_message,
                                      reasons_first=bool(kw.get("enable_thinking"))) \
        if tags else ReasoningStart.OUTSIDE
    assembler = OutputAssembler(
        loaded.tokenizer, stop=list(req.stop), reasoning_tags=tags, reasoning_start=start,
        hold_trailing_space=req.continue_final_message,
        logprobs_style="chat" if req.logprobs else None, tool_parser=plan.parser())
    prefix = (req.messages[-1].content or "") if req.continue_final_message and grammar else ""
    gen = _submit(state, "chatcmpl", ids, req, assembler=assembler,
                  num_top=req.top_logprobs if req.logprobs else None,
                  grammar=grammar, grammar_prefix=prefix)
    created, model = int(time.time()), loaded.name
    if req.stream:
        return await _stream_chat(request, gen, req, created, model)
    content, reasoning, logprobs, finish = [], [], [], None
    async for d in gen.deltas():
        content.append(d.content)
        reasoning.append(d.reasoning)
        logprobs += d.logprobs
        finish = d.finish_reason or finish
    text = "".join(content)
    calls = assembler.tool_parser.tool_calls if assembler.tool_parser else []
    message = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        message["tool_calls"] = [tool_call_json(c) for c in calls]
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    body = {
        "id": gen.request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message,
                     "logprobs": {"content": logprobs} if req.logprobs else None,
                     "finish_reason": finish}],
        "usage": usage(assembler.totals, state.config.ctx_len),
    }
    return _json(body)


async def _stream_chat(request, gen: Generation, req, created: int, model: str):
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

    return await _send_sse(request, events())


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
    gen = _submit(state, "cmpl", ids, req, assembler=assembler,
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

        return await _send_sse(request, events())
    text, entries, finish = [], [], None
    async for d in gen.deltas():
        text.append(d.content)
        entries += d.logprobs
        finish = d.finish_reason or finish
    body = {"id": gen.request_id, "object": "text_completion", "created": created,
            "model": model, "choices": [choice(echo + "".join(text), entries, finish,
                                               len(echo))],
            "usage": usage(assembler.totals, state.config.ctx_len)}
    return _json(body)


def _cmpl_chunk(gen, created, model, fingerprint, req, choice) -> dict:
    c = {"id": gen.request_id, "object": "text_completion", "created": created,
         "model": model, "system_fingerprint": fingerprint,
         "choices": [choice] if choice else []}
    if req.include_usage:
        c["usage"] = None
    return c


def _json(body: dict):
    from sanic.response import json as sanic_json

    return sanic_json(body)


async def _send_sse(request, events):
    response = await request.respond(content_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
    try:
        async for event in events:
            await response.send(f"data: {json.dumps(event)}\n\n")
    except InternalServerError as exc:
        # Headers are gone already: report in-band, as OpenAI's streams do.
        await response.send(f"data: {json.dumps(error_body(exc))}\n\n")
    await response.send("data: [DONE]\n\n")
    await response.eof()
    return None
