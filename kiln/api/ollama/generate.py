"""Ollama's /api/chat and /api/generate on kiln's chat pipeline (api/chat.py).

Each request becomes its /v1 equivalent (request.py) and runs as one: /api/chat and a
templated /api/generate through prepare_chat, a raw /api/generate through the completions
path (the prompt tokenized as it is). Replies stream as NDJSON by default: one object per
piece of text, then a last one with `done: true`, `done_reason` and the timings in
nanoseconds; with `stream: false`, one object holding the whole reply.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from kiln.api.chat import Generation, collect, prepare_chat, submit
from kiln.api.errors import InternalServerError
from kiln.api.generation import OutputAssembler
from kiln.api.json_fields import load_json_body
from kiln.api.ollama.request import OllamaRequest, chat_request, generate_request
from kiln.api.ollama.wire import nanoseconds, timestamp
from kiln.api.protocol import parse_chat_request, parse_completion_request
from kiln.api.responses import new_id
from kiln.api.state import ServerState
from kiln.api.streaming import json_response, send_ndjson
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling.grammar import GrammarSpec


async def chat(request):
    return await _answer(request, chat_request, chat=True)


async def generate(request):
    return await _answer(request, generate_request, chat=False)


async def _answer(request, parse, chat: bool):
    started = time.monotonic()
    state: ServerState = request.app.ctx.state
    req: OllamaRequest = parse(load_json_body(request.body))
    # Every check before the model is touched: a bad request changes nothing.
    checked = None if req.load_only else \
        parse_completion_request({**req.v1, "prompt": req.prompt}) if req.raw else \
        parse_chat_request(req.v1)
    await state.ensure_model(req.model)  # (at once when it is loaded already)
    reply = Reply(req.model, chat, started, load_s=time.monotonic() - started)
    if req.load_only:  # Ollama loads the model and says so
        return json_response(reply.loaded())
    if req.raw:
        reply.gen = await _submit_raw(state, req, checked)
    else:
        reply.gen = (await prepare_chat(state, checked)).submit(state, "ollama")
    logprobs = req.top_logprobs is not None
    if req.stream:
        return await send_ndjson(request, reply.stream(logprobs))
    return json_response(await reply.whole(logprobs))


async def _submit_raw(state: ServerState, req: OllamaRequest, creq) -> Generation:
    """The prompt as it is, no template (as /v1/completions reads a text prompt)."""
    tok = state.loaded.tokenizer
    ids = tok.encode(req.prompt, add_special_tokens=True)
    if not ids:
        raise InvalidRequestError("The prompt is empty once tokenized.", param="prompt")
    engine_kw = {}
    fmt = req.raw_format
    if fmt is not None:  # compiled off the event loop, as prepare_chat does
        spec = GrammarSpec("json_object") if fmt["type"] == "json_object" else \
            GrammarSpec.json_schema(fmt["json_schema"]["schema"], param="format")
        engine = state.engine
        engine_kw["grammar"] = await asyncio.get_running_loop().run_in_executor(
            None, engine.compile_grammar, spec)
        if state.engine is not engine:
            raise InternalServerError(new_id("req"), "The model was switched meanwhile.")
    assembler = OutputAssembler(tok, stop=list(creq.stop),
                                logprobs_style="chat" if req.top_logprobs is not None else None)
    return submit(state, "ollama", ids, creq, num_top=req.top_logprobs, assembler=assembler,
                  **engine_kw)


@dataclass
class Reply:
    """One reply in Ollama's shape: /api/chat's `message`, or /api/generate's `response`."""

    model: str
    chat: bool
    started: float  # time.monotonic() when the request arrived
    load_s: float  # seconds spent loading the model for it
    gen: Generation | None = None

    def head(self) -> dict:
        return {"model": self.model, "created_at": timestamp()}

    def piece(self, content: str, thinking: str = "", calls: list | None = None) -> dict:
        out = self.head()
        if self.chat:
            message = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def loaded(self) -> dict:
        out = self.piece("")
        out.update(done=True, done_reason="load")
        return out

    def last(self, out: dict, finish: str | None) -> dict:
        """`out` made the reply's last object: done, why, and Ollama's counts and timings."""
        t = self.gen.assembler.totals
        end = t.finish_time or time.monotonic()
        first = t.first_token_time or end
        out.update(done=True, done_reason=_done_reason(finish),
                   total_duration=nanoseconds(time.monotonic() - self.started),
                   load_duration=nanoseconds(self.load_s),
                   prompt_eval_count=t.prompt_tokens,
                   prompt_eval_duration=nanoseconds(first - t.arrival_time)
                   if t.arrival_time else 0,  # (0: the engine never took it up)
                   eval_count=t.completion_tokens,
                   eval_duration=nanoseconds(end - first))
        return out

    async def stream(self, logprobs: bool):
        finish = None
        async for d in self.gen.deltas():
            if d.content or d.reasoning or (logprobs and d.logprobs):
                out = self.piece(d.content, d.reasoning)
                if logprobs and d.logprobs:
                    out["logprobs"] = d.logprobs
                yield out
            finish = d.finish_reason or finish
        calls = self._calls()
        if calls:  # whole calls, once the reply has ended (Ollama sends no partial ones)
            yield self.piece("", calls=calls)
        yield self.last(self.piece(""), finish)

    async def whole(self, logprobs: bool) -> dict:
        result = await collect(self.gen)
        out = self.piece(result.content, result.reasoning, self._calls())
        if logprobs:
            out["logprobs"] = result.logprobs
        return self.last(out, result.finish_reason)

    def _calls(self) -> list[dict]:
        parser = self.gen.assembler.tool_parser
        calls = []
        for i, call in enumerate(parser.tool_calls if parser else []):
            try:
                arguments = json.loads(call.arguments or "{}")
            except ValueError:
                continue  # cut short (done_reason "length"): not a call a client can run
            if isinstance(arguments, dict):
                calls.append({"id": call.id, "function": {"index": i, "name": call.name,
                                                          "arguments": arguments}})
        return calls


def _done_reason(finish: str | None) -> str:
    # Ollama says "stop" when the model ended its turn, calls or not.
    return "stop" if finish in (None, "tool_calls") else finish
