"""The two generation endpoints. Everything that can be rejected is checked before the
engine sees the request (and before a stream starts); then outputs flow one way: engine ->
OutputAssembler -> response body or SSE chunks. A request's choices (n, and /v1/completions'
several prompts) run side by side in the engine and are interleaved, each with its index."""

from __future__ import annotations

import asyncio
import time

from kiln.api.chat import Generation, collect, interleave, prepare_chat, submit_choices
from kiln.api.generation import OutputAssembler, combined_totals
from kiln.api.json_fields import load_json_body
from kiln.api.protocol import parse_chat_request, parse_completion_request
from kiln.api.responses import completion_logprobs, system_fingerprint, usage
from kiln.api.state import ServerState
from kiln.api.streaming import json_response, send_sse
from kiln.api.tools import tool_call_json
from kiln.runtime.errors import InvalidRequestError


def _usage(state: ServerState, gens: list[Generation], n: int) -> dict:
    return usage(combined_totals([g.assembler.totals for g in gens], n), state.config.ctx_len)


async def chat_completions(request):
    state: ServerState = request.app.ctx.state
    req = parse_chat_request(load_json_body(request.body))
    job = await prepare_chat(state, req)
    gens = job.submit_all(state)
    created, model = int(time.time()), state.loaded.name
    if req.stream:
        return await _stream_chat(request, gens, req, created, model)
    results = await asyncio.gather(*(collect(g) for g in gens))
    choices = []
    for i, result in enumerate(results):
        calls = result.tool_calls
        message = {"role": "assistant",
                   "content": result.content if (result.content or not calls) else None}
        if calls:
            message["tool_calls"] = [tool_call_json(c) for c in calls]
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": result.logprobs} if req.logprobs else None,
                        "finish_reason": result.finish_reason})
    body = {"id": gens[0].request_id, "object": "chat.completion", "created": created,
            "model": model, "choices": choices, "usage": _usage(state, gens, req.n)}
    return json_response(body)


async def _stream_chat(request, gens: list[Generation], req, created: int, model: str):
    fingerprint = system_fingerprint()

    def chunk(i: int, delta: dict, finish=None, logprobs=None) -> dict:
        c = {"id": gens[0].request_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "system_fingerprint": fingerprint,
             "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish}]}
        if req.include_usage:
            c["usage"] = None
        return c

    async def events():
        for i in range(len(gens)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, d in interleave(gens):
            lp = {"content": d.logprobs} if req.logprobs and d.logprobs else None
            if d.reasoning:
                yield chunk(i, {"reasoning_content": d.reasoning})
            if d.content or lp:
                yield chunk(i, {"content": d.content}, logprobs=lp)
            if d.tool_calls:
                yield chunk(i, {"tool_calls": [t.to_json() for t in d.tool_calls]})
            if d.finish_reason:
                yield chunk(i, {}, finish=d.finish_reason)
        if req.include_usage:
            u = chunk(0, {})
            u["choices"], u["usage"] = [], _usage(gens[0].state, gens, req.n)
            yield u

    return await send_sse(request, events())


def _completion_prompt(tok, prompt) -> tuple[list[int], str]:
    """(token ids, text) of one prompt: text is tokenized, ids are checked and decoded."""
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_special_tokens=True)
        if not ids:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        return ids, prompt
    ids = list(prompt)
    if max(ids) >= tok.vocab_size:
        raise InvalidRequestError(f"Token id {max(ids)} is outside the vocabulary "
                                  f"(size {tok.vocab_size}).", param="prompt")
    return ids, tok.decode(ids)


async def completions(request):
    state: ServerState = request.app.ctx.state
    req = parse_completion_request(load_json_body(request.body))
    await state.ensure_model(req.model)
    loaded = state.loaded
    tok = loaded.tokenizer
    prompts = [_completion_prompt(tok, p) for p in req.prompts]
    want_logprobs = req.logprobs is not None
    echo_logprobs = req.echo and want_logprobs  # the prompt's tokens get entries too
    gens = submit_choices(
        state, "cmpl", [ids for ids, _ in prompts], req,
        num_top=req.logprobs if want_logprobs else None, n=req.n,
        prompt_logprobs=req.logprobs if echo_logprobs else None,
        make_assembler=lambda: OutputAssembler(
            tok, stop=list(req.stop), logprobs_style="completions" if want_logprobs else None))
    created, model = int(time.time()), loaded.name
    # Choice c answers prompt c // n; its echo (and the prompt's logprobs) come first.
    echoes = [prompts[c // req.n][1] if req.echo else "" for c in range(len(gens))]
    prompt_entries: list[list[dict] | None] = [None] * len(prompts)

    def echo_entries(c: int, delta) -> list[dict]:
        """The prompt's logprob entries, from choice 0 of its prompt (the one that read it)."""
        p = c // req.n
        if delta.prompt_logprobs is not None:
            ids = prompts[p][0]
            first = {"token": gens[c].assembler.detok.token_text(ids[0]), "logprob": None,
                     "top_logprobs": None}
            prompt_entries[p] = [first] + delta.prompt_logprobs[1:]
        return prompt_entries[p] or []

    def choice(c: int, text: str, entries: list[dict], finish, offset: int) -> dict:
        return {"index": c, "text": text, "finish_reason": finish,
                "logprobs": completion_logprobs(entries, offset) if want_logprobs else None}

    if req.stream:
        fingerprint = system_fingerprint()

        async def events():
            offsets = [0] * len(gens)
            started = [False] * len(gens)
            async for c, d in interleave(gens):
                entries = d.logprobs
                text = d.content
                if not started[c]:  # the echo goes out with the choice's first delta
                    started[c] = True
                    if req.echo:
                        head = echo_entries(c, d) if echo_logprobs else []
                        text, entries = echoes[c] + text, head + entries
                if text or entries or d.finish_reason:
                    yield _cmpl_chunk(gens[0].request_id, created, model, fingerprint, req,
                                      choice(c, text, entries, d.finish_reason, offsets[c]))
                    offsets[c] += len(text)
            if req.include_usage:
                u = _cmpl_chunk(gens[0].request_id, created, model, fingerprint, req, None)
                u["usage"] = _usage(state, gens, req.n)
                yield u

        return await send_sse(request, events())
    texts = [[] for _ in gens]
    entries = [[] for _ in gens]
    finish = [None] * len(gens)
    heads = [[] for _ in gens]
    async for c, d in interleave(gens):
        if echo_logprobs and d.prompt_logprobs is not None:
            heads[c] = echo_entries(c, d)
        texts[c].append(d.content)
        entries[c] += d.logprobs
        finish[c] = d.finish_reason or finish[c]
    if echo_logprobs:  # siblings share their prompt's entries
        heads = [heads[c] or prompt_entries[c // req.n] or [] for c in range(len(gens))]
    choices = [choice(c, echoes[c] + "".join(texts[c]), heads[c] + entries[c], finish[c], 0)
               for c in range(len(gens))]
    body = {"id": gens[0].request_id, "object": "text_completion", "created": created,
            "model": model, "choices": choices, "usage": _usage(state, gens, req.n)}
    return json_response(body)


def _cmpl_chunk(request_id, created, model, fingerprint, req, choice) -> dict:
    c = {"id": request_id, "object": "text_completion", "created": created,
         "model": model, "system_fingerprint": fingerprint,
         "choices": [choice] if choice else []}
    if req.include_usage:
        c["usage"] = None
    return c
