"""Ollama's /api/chat and /api/generate on kiln's pipelines.

Each body is read into kiln's own request (api/protocol/ollama.py) and runs as one: /api/chat
and a templated /api/generate through the chat pipeline, a raw /api/generate as
/v1/completions runs a text prompt. Replies stream as NDJSON by default: one object per piece
of text, then a last one with `done: true`, `done_reason` and the timings in nanoseconds; with
`stream: false`, one object holding the whole reply.
"""

from __future__ import annotations

import json
import time

from kiln.api.pipeline.admission import Admitted, Generation, admit, check_prompt_text
from kiln.api.pipeline.assembler import Delta, OutputAssembler
from kiln.api.pipeline.chat import prepare_chat
from kiln.api.pipeline.reply import ChoiceText, json_response, send_reply
from kiln.api.pipeline.workers import off_loop, read_body
from kiln.api.protocol.ollama import OllamaRequest, chat_request, generate_request
from kiln.api.routes.ollama_wire import nanoseconds, timestamp
from kiln.api.state import ServerState, Serving
from kiln.runtime.errors import InvalidRequestError, KilnError


async def chat(request):
    return await _answer(request, chat_request, chat=True)


async def generate(request):
    return await _answer(request, generate_request, chat=False)


async def _answer(request, parse, chat: bool):
    started = time.monotonic()
    state: ServerState = request.app.ctx.state
    req: OllamaRequest = await read_body(request, parse)  # every check first
    async with state.use(req.model) as serving:
        load_s = time.monotonic() - started
        if req.load_only:  # Ollama loads the model and says so
            return json_response(OllamaReply(req.model, chat, started, load_s).loaded())
        if req.raw:
            admitted = await _admit_raw(state, serving, req)
        else:
            job = await off_loop(prepare_chat, serving, req.chat)
            admitted = await job.admit(state, "ollama", n=1)
        reply = OllamaReply(req.model, chat, started, load_s, admitted.generations[0],
                            logprobs=req.top_logprobs is not None)
        return await send_reply(request, admitted.generations, reply, req.stream)


async def _admit_raw(state: ServerState, serving: Serving, req: OllamaRequest) -> Admitted:
    """The prompt as it is, no template (as /v1/completions reads a text prompt)."""
    creq, tok = req.completion, serving.model.tokenizer
    check_prompt_text(serving, creq.prompt)
    ids = await off_loop(lambda: tok.encode(creq.prompt, add_special_tokens=True))
    if not ids:
        raise InvalidRequestError("The prompt is empty once tokenized.", param="prompt")
    style = "chat" if req.top_logprobs is not None else None
    return await admit(state, serving, "ollama", [ids], creq.sampling, creq.options,
                       lambda: OutputAssembler(tok, stop=list(creq.options.stop),
                                               logprobs_style=style),
                       grammar=req.raw_format.grammar() if req.raw_format else None)


class OllamaReply:
    """One reply in Ollama's shape: /api/chat's `message`, or /api/generate's `response`."""

    framing = "ndjson"

    def __init__(self, model: str, chat: bool, started: float, load_s: float,
                 gen: Generation | None = None, logprobs: bool = False):
        self.model, self.chat, self.gen, self.logprobs = model, chat, gen, logprobs
        self.started = started  # time.monotonic() when the request arrived
        self.load_s = load_s  # seconds spent loading the model for it
        self.text = ChoiceText()

    def piece(self, content: str, thinking: str = "", calls: list | None = None) -> dict:
        out = {"model": self.model, "created_at": timestamp()}
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

    def last(self, out: dict) -> dict:
        """`out` made the reply's last object: done, why, and Ollama's counts and timings."""
        t = self.gen.assembler.totals
        end = t.finish_time or time.monotonic()
        first = t.first_token_time or end
        finish = self.text.finish_reason
        out.update(done=True,  # Ollama says "stop" when the model ended its turn, calls or not
                   done_reason="stop" if finish in (None, "tool_calls") else finish,
                   total_duration=nanoseconds(time.monotonic() - self.started),
                   load_duration=nanoseconds(self.load_s),
                   prompt_eval_count=t.prompt_tokens,
                   prompt_eval_duration=nanoseconds(first - t.arrival_time)
                   if t.arrival_time else 0,  # (0: the engine never took it up)
                   eval_count=t.completion_tokens,
                   eval_duration=nanoseconds(end - first))
        return out

    def start(self) -> list[dict]:
        return []

    def feed(self, choice: int, d: Delta) -> list[dict]:
        self.text.feed(d)
        if not (d.content or d.reasoning or (self.logprobs and d.logprobs)):
            return []
        out = self.piece(d.content, d.reasoning)
        if self.logprobs and d.logprobs:
            out["logprobs"] = d.logprobs
        return [out]

    def finish(self) -> list[dict]:
        calls = self._calls()  # whole calls, once the reply has ended (Ollama sends no parts)
        return ([self.piece("", calls=calls)] if calls else []) + [self.last(self.piece(""))]

    def fail(self, exc: KilnError) -> list[dict]:
        return [{"error": exc.message}]

    def body(self) -> dict:
        out = self.piece(self.text.text, self.text.reasoning_text, self._calls())
        if self.logprobs:
            out["logprobs"] = self.text.logprobs
        return self.last(out)

    def _calls(self) -> list[dict]:
        calls = []
        for i, call in enumerate(self.text.tool_calls):
            try:
                arguments = json.loads(call.arguments or "{}")
            except ValueError:
                continue  # cut short (done_reason "length"): not a call a client can run
            if isinstance(arguments, dict):
                calls.append({"id": call.id, "function": {"index": i, "name": call.name,
                                                          "arguments": arguments}})
        return calls
