"""The chat pipeline every chat-shaped route shares (/v1/chat/completions, /v1/responses,
Ollama's /api/chat and templated /api/generate): a checked ChatCompletionRequest -> the loaded
model's template on its messages, tokenized, with its tool plan and grammar (`prepare_chat`)
-> admitted engine requests (`ChatJob.admit`).

A route only reads its own body into a ChatCompletionRequest and writes the deltas in its own
shape; the sampling contract, the sticky settings, the tool-call grammar and every 400 are
decided here and in admission, once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.api.pipeline.admission import Admitted, admit, check_prompt_text
from kiln.api.pipeline.assembler import OutputAssembler
from kiln.api.protocol.chat import ChatCompletionRequest
from kiln.api.state import ServerState, Serving
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling.settings import SamplingFields
from kiln.runtime.text.chat_template import TemplateError
from kiln.runtime.text.continuation import continuation_prompt
from kiln.runtime.text.reasoning import ReasoningStart
from kiln.runtime.text.tool_plan import ToolPlan, plan_tools
from kiln.runtime.text.tools import (
    ToolCallFormat,
    template_handles_tools,
    tool_format_for,
    tool_messages,
)


def think_kwargs(serving: Serving, sent: SamplingFields) -> dict:
    """The chat template's thinking switches: the request's, else the sticky ones."""
    current = serving.settings.current
    think = sent.think if sent.think is not None else current.think
    effort = sent.reasoning_effort if sent.reasoning_effort is not None \
        else current.reasoning_effort
    kw = {}
    if think is not None:
        kw["enable_thinking"] = think
    if effort is not None:
        kw["reasoning_effort"] = effort
    return kw


def tool_plan(req: ChatCompletionRequest, fmt: ToolCallFormat) -> ToolPlan:
    """What the request's tools, tool_choice, parallel_tool_calls and response_format mean
    for a model family that writes calls in `fmt`."""
    return plan_tools(fmt, req.tools, req.tool_choice, req.parallel_tool_calls,
                      req.response_format.grammar() if req.response_format else None)


def render_chat(serving: Serving, req: ChatCompletionRequest,
                add_generation_prompt: bool = True) -> tuple[str, ToolPlan, dict]:
    """The loaded model's template on the request's messages (tools in the prompt, or
    described in the system message when the template ignores them): (prompt text, the
    tool plan, the thinking switches). /tokenize's chat form reads the same text."""
    model = serving.model
    if model.chat_template is None:
        raise InvalidRequestError(f"The model `{model.name}` has no chat template: send its "
                                  "prompt to /v1/completions instead.", param="messages",
                                  code="no_chat_template")
    plan = tool_plan(req, tool_format_for(model.name))
    messages = [m.to_template() for m in req.messages]
    if template_handles_tools(model.chat_template.template_str):
        tools = [t.to_template() for t in plan.prompt_tools] or None
    else:  # the template ignores tools: describe them in the system message ourselves
        messages, tools = tool_messages(messages, plan.prompt_tools, plan.format), None
    kw = think_kwargs(serving, req.sampling)
    try:
        if req.continue_final_message:
            rendered = model.chat_template.render(messages, add_generation_prompt=False,
                                                  tools=tools, **kw)
            prompt = continuation_prompt(rendered, req.messages[-1].content or "")
        else:
            prompt = model.chat_template.render(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **kw)
    except TemplateError as exc:
        raise InvalidRequestError(f"The chat template rejected the messages: {exc}",
                                  param="messages") from exc
    return prompt, plan, kw


@dataclass
class ChatJob:
    """A chat request made ready for the engine: what every choice of it shares."""

    req: ChatCompletionRequest
    serving: Serving
    prompt: str
    ids: list[int]
    plan: ToolPlan
    reasoning_start: ReasoningStart

    def assembler(self) -> OutputAssembler:
        """A fresh assembler (one per choice)."""
        req, model = self.req, self.serving.model
        return OutputAssembler(
            model.tokenizer, stop=list(req.options.stop), reasoning_tags=model.reasoning_tags,
            reasoning_start=self.reasoning_start, hold_trailing_space=req.continue_final_message,
            logprobs_style="chat" if req.options.logprobs is not None else None,
            tool_parser=self.plan.parser())

    async def admit(self, state: ServerState, prefix: str, n: int | None = None) -> Admitted:
        """The request's n choices (req.n unless given)."""
        req, grammar = self.req, self.plan.grammar
        # A continued message under a grammar: the grammar must accept its text first.
        prefix_text = (req.messages[-1].content or "") \
            if req.continue_final_message and grammar is not None else ""
        return await admit(state, self.serving, prefix, [self.ids], req.sampling, req.options,
                           self.assembler, n=req.n if n is None else n, grammar=grammar,
                           grammar_prefix=prefix_text)


def prepare_chat(serving: Serving, req: ChatCompletionRequest) -> ChatJob:
    """Render the request's messages with the model's template and tokenize them: blocking
    (a long chat takes seconds), so off the event loop."""
    model = serving.model
    prompt, plan, kw = render_chat(serving, req)
    check_prompt_text(serving, prompt)
    ids = model.tokenizer.encode(prompt, add_special_tokens=False)
    tags = model.reasoning_tags
    start = ReasoningStart.for_prompt(prompt, tags, continuing=req.continue_final_message,
                                      reasons_first=bool(kw.get("enable_thinking"))) \
        if tags else ReasoningStart.OUTSIDE
    return ChatJob(req, serving, prompt, ids, plan, start)
