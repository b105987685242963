"""POST /v1/chat/completions: a chat.completion body, or its chunks as SSE. A request's n
choices run side by side in the engine; their deltas are interleaved, each with its index."""

from __future__ import annotations

from kiln.api.pipeline.admission import Generation
from kiln.api.pipeline.assembler import Delta
from kiln.api.pipeline.chat import prepare_chat
from kiln.api.pipeline.openai_reply import OpenAIReply
from kiln.api.pipeline.reply import ChoiceText, send_reply
from kiln.api.pipeline.workers import off_loop, read_body
from kiln.api.protocol.chat import ChatCompletionRequest, parse_chat_request
from kiln.api.state import ServerState, Serving
from kiln.runtime.text.tool_parser import ToolCallDelta
from kiln.runtime.text.tools import ToolCall


def tool_call_json(call: ToolCall) -> dict:
    """A complete call, as `choices[0].message.tool_calls[i]`."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_json(d: ToolCallDelta) -> dict:
    """As `choices[0].delta.tool_calls[i]` in a stream chunk: the first carries id and name."""
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {"index": d.index, "id": d.id, "type": "function",
            "function": {"name": d.name, "arguments": d.arguments}}


class ChatCompletionReply(OpenAIReply):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, gens: list[Generation], serving: Serving):
        super().__init__(gens, req.n, req.include_usage, serving)
        self.logprobs = req.options.logprobs is not None
        self.choices = [ChoiceText() for _ in gens]

    def _chunk(self, i: int, delta: dict, finish=None, logprobs=None) -> dict:
        return self.chunk([{"index": i, "delta": delta, "logprobs": logprobs,
                            "finish_reason": finish}])

    def start(self) -> list[dict]:
        return [self._chunk(i, {"role": "assistant", "content": ""})
                for i in range(len(self.gens))]

    def feed(self, i: int, d: Delta) -> list[dict]:
        self.choices[i].feed(d)
        lp = {"content": d.logprobs} if self.logprobs and d.logprobs else None
        events = []
        if d.reasoning:
            events.append(self._chunk(i, {"reasoning_content": d.reasoning}))
        if d.content or lp:
            events.append(self._chunk(i, {"content": d.content}, logprobs=lp))
        if d.tool_calls:
            events.append(self._chunk(i, {"tool_calls": [tool_call_delta_json(t)
                                                         for t in d.tool_calls]}))
        if d.finish_reason:
            events.append(self._chunk(i, {}, finish=d.finish_reason))
        return events

    def body(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            calls, text = c.tool_calls, c.text
            message = {"role": "assistant", "content": text if (text or not calls) else None}
            if calls:
                message["tool_calls"] = [tool_call_json(call) for call in calls]
            if c.reasoning_text:
                message["reasoning_content"] = c.reasoning_text
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": c.logprobs} if self.logprobs else None,
                            "finish_reason": c.finish_reason})
        return self.whole(choices)


async def chat_completions(request):
    state: ServerState = request.app.ctx.state
    req = await read_body(request, parse_chat_request)
    async with state.use(req.model) as serving:
        job = await off_loop(prepare_chat, serving, req)
        admitted = await job.admit(state, "chatcmpl")
        reply = ChatCompletionReply(req, admitted.generations, serving)
        return await send_reply(request, admitted.generations, reply, req.stream)
