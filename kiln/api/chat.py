"""The chat pipeline every chat-shaped route shares (/v1/chat/completions, /v1/responses,
Ollama's /api/chat): a checked ChatCompletionRequest -> a rendered, tokenized prompt with its
grammar (`prepare_chat`) -> an engine request (`submit`) -> deltas, or one collected result.

A route only translates its own request shape into a ChatCompletionRequest and the deltas
or the ChatResult into its own response shape; the sampling contract, the sticky settings,
the tool-call grammar and every 400 are decided here, once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from kiln.api.continuation import continuation_prompt
from kiln.api.errors import InternalServerError, ServiceUnavailableError
from kiln.api.generation import Delta, OutputAssembler
from kiln.api.protocol import ChatCompletionRequest
from kiln.api.reasoning import ReasoningStart
from kiln.api.responses import new_id
from kiln.api.state import ServerState
from kiln.api.tools import (
    ToolPlan,
    plan_tools,
    template_handles_tools,
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
        finish = "abort"  # until the engine says otherwise (a client that hung up)
        try:
            async for out in self.stream:
                delta = self.assembler.add(out, time.monotonic())
                finish = delta.finish_reason or finish
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
            self.state.metrics.request_finished(self.assembler.totals, finish)


def submit(state: ServerState, prefix: str, ids: list[int], req, *, num_top: int | None,
           assembler: OutputAssembler, request_id: str | None = None,
           **engine_kw) -> Generation:
    """Admit one engine request: the context check, then the sticky settings' snapshot."""
    return submit_choices(state, prefix, [ids], req, num_top=num_top,
                          make_assembler=lambda: assembler, request_id=request_id,
                          **engine_kw)[0]


def submit_choices(state: ServerState, prefix: str, prompts: list[list[int]], req, *,
                   num_top: int | None, make_assembler: Callable[[], OutputAssembler],
                   n: int = 1, request_id: str | None = None,
                   prompt_logprobs: int | None = None, **engine_kw) -> list[Generation]:
    """Admit n choices of each prompt (choice p * n + i): every context check first, then
    one snapshot of the sticky settings for them all. Choice i > 0 of a prompt waits for
    choice 0's prefill and reads the prompt's blocks from the prefix cache; with a seed, it
    draws from seed + i, so the n streams differ and each repeats."""
    if state.draining:
        raise ServiceUnavailableError()
    engine = state.engine
    for ids in prompts:
        engine.check_context(len(ids), req.max_tokens)  # before settings change
    sampling = state.settings.admit(req.sampling)
    request_id = request_id or new_id(prefix)
    gens = []
    for p, ids in enumerate(prompts):
        leader = None  # the request id of the prompt's choice 0
        for i in range(n):
            choice = p * n + i
            rid = request_id if choice == 0 else f"{request_id}-{choice}"
            seeded = sampling if i == 0 or sampling.seed is None \
                else replace(sampling, seed=_wrap_int64(sampling.seed + i))
            stream = engine.add_request(
                rid, ids, seeded, max_tokens=req.max_tokens, num_top_logprobs=num_top,
                stop=list(req.stop), logit_bias=req.logit_bias, min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos, prefill_leader=leader,
                prompt_logprobs=prompt_logprobs if i == 0 else None, **engine_kw)
            leader = leader or rid
            gens.append(Generation(rid, stream, make_assembler(), state))
    return gens


def _wrap_int64(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


async def interleave(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """The choices' deltas as they come, tagged with the choice's index. Leaving early (a
    client gone) or an error in one choice ends every choice's engine request."""
    if len(gens) == 1:
        async for d in gens[0].deltas():
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for d in gen.deltas():
                queue.put_nowait((i, d))
            queue.put_nowait((i, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader below
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(gens)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def think_kwargs(state: ServerState, sent) -> dict:
    """The chat template's thinking switches: the request's, else the sticky ones."""
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


@dataclass
class ChatJob:
    """A chat request made ready for the engine: what every choice of it shares."""

    req: ChatCompletionRequest
    prompt: str
    ids: list[int]
    plan: ToolPlan
    grammar: object | None  # xgrammar.CompiledGrammar
    grammar_prefix: str
    reasoning_start: ReasoningStart

    def assembler(self, state: ServerState) -> OutputAssembler:
        """A fresh assembler (one per choice)."""
        req = self.req
        return OutputAssembler(
            state.loaded.tokenizer, stop=list(req.stop), reasoning_tags=state.loaded.reasoning_tags,
            reasoning_start=self.reasoning_start, hold_trailing_space=req.continue_final_message,
            logprobs_style="chat" if req.logprobs else None, tool_parser=self.plan.parser())

    def submit(self, state: ServerState, prefix: str = "chatcmpl") -> Generation:
        return self.submit_all(state, prefix, n=1)[0]

    def submit_all(self, state: ServerState, prefix: str = "chatcmpl",
                   n: int | None = None) -> list[Generation]:
        """The request's n choices (req.n unless given)."""
        req = self.req
        return submit_choices(state, prefix, [self.ids], req,
                              num_top=req.top_logprobs if req.logprobs else None,
                              make_assembler=lambda: self.assembler(state),
                              n=req.n if n is None else n, grammar=self.grammar,
                              grammar_prefix=self.grammar_prefix)


def render_chat(state: ServerState, req: ChatCompletionRequest,
                add_generation_prompt: bool = True) -> tuple[str, ToolPlan, dict]:
    """The loaded model's template on the request's messages (tools in the prompt, or
    described in the system message when the template ignores them): (prompt text, the
    tool plan, the thinking switches). /tokenize's chat form reads the same text."""
    loaded = state.loaded
    if loaded.chat_template is None:
        raise InvalidRequestError(f"The model `{loaded.name}` has no chat template: send its "
                                  "prompt to /v1/completions instead.", param="messages",
                                  code="no_chat_template")
    plan = plan_tools(req, tool_format_for(loaded.name))
    messages = [m.to_template() for m in req.messages]
    if template_handles_tools(loaded.chat_template.template_str):
        tools = [t.to_template() for t in plan.prompt_tools] or None
    else:  # the template ignores tools: describe them in the system message ourselves
        messages, tools = tool_messages(messages, plan.prompt_tools, plan.format), None
    kw = think_kwargs(state, req.sampling)
    try:
        if req.continue_final_message:
            rendered = loaded.chat_template.render(messages, add_generation_prompt=False,
                                                   tools=tools, **kw)
            prompt = continuation_prompt(rendered, req.messages[-1].content or "")
        else:
            prompt = loaded.chat_template.render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **kw)
    except TemplateError as exc:
        raise InvalidRequestError(f"The chat template rejected the messages: {exc}",
                                  param="messages") from exc
    return prompt, plan, kw


async def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> ChatJob:
    """Load the model the request names, render its messages with the model's template,
    tokenize, and compile the grammar of a forced tool call or response_format."""
    await state.ensure_model(req.model)
    loaded, engine = state.loaded, state.engine
    prompt, plan, kw = render_chat(state, req)
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
    prefix = (req.messages[-1].content or "") if req.continue_final_message and grammar else ""
    return ChatJob(req=req, prompt=prompt, ids=ids, plan=plan, grammar=grammar,
                   grammar_prefix=prefix, reasoning_start=start)


@dataclass
class ChatResult:
    """A whole reply, collected from its deltas."""

    content: str = ""
    reasoning: str = ""
    logprobs: list[dict] = field(default_factory=list)
    tool_calls: list = field(default_factory=list)  # api.protocol.ToolCall
    finish_reason: str | None = None


async def collect(gen: Generation) -> ChatResult:
    content, reasoning, result = [], [], ChatResult()
    async for d in gen.deltas():
        content.append(d.content)
        reasoning.append(d.reasoning)
        result.logprobs += d.logprobs
        result.finish_reason = d.finish_reason or result.finish_reason
    result.content, result.reasoning = "".join(content), "".join(reasoning)
    parser = gen.assembler.tool_parser
    result.tool_calls = parser.tool_calls if parser else []
    return result
