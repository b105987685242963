"""POST /v1/responses: OpenAI's Responses API (what Codex-style agents speak) on the chat
pipeline. The body is read into a chat request (api/protocol/responses.py), run as the chat
route runs it (same grammar, sampler, sticky settings and 400s, all decided before a stream
starts), and the deltas are written out as a Response object or its SSE events
(api/pipeline/responses_builder.py)."""

from __future__ import annotations

from kiln.api.pipeline.admission import Generation
from kiln.api.pipeline.assembler import Delta
from kiln.api.pipeline.chat import prepare_chat
from kiln.api.pipeline.reply import send_reply
from kiln.api.pipeline.responses_builder import ResponseBuilder, new_response
from kiln.api.pipeline.usage import responses_usage, usage
from kiln.api.pipeline.workers import off_loop, read_body
from kiln.api.protocol.responses import parse_responses_request
from kiln.api.state import ServerState
from kiln.runtime.errors import KilnError


class ResponsesReply:
    framing = "sse-named"

    def __init__(self, builder: ResponseBuilder, gen: Generation, ctx_len: int):
        self.builder, self.gen, self.ctx_len = builder, gen, ctx_len

    def start(self) -> list[dict]:
        return self.builder.start()

    def feed(self, choice: int, d: Delta) -> list[dict]:
        return self.builder.feed(d)

    def finish(self) -> list[dict]:
        return self.builder.finish(responses_usage(usage(self.gen.assembler.totals,
                                                         self.ctx_len)))

    def fail(self, exc: KilnError) -> list[dict]:
        return self.builder.fail(exc.message)

    def body(self) -> dict:
        return self.builder.response


async def create_response(request):
    state: ServerState = request.app.ctx.state
    req = await read_body(request, parse_responses_request)
    async with state.use(req.chat.model) as serving:
        job = await off_loop(prepare_chat, serving, req.chat)
        admitted = await job.admit(state, "resp", n=1)
        gen = admitted.generations[0]
        # The engine's id ("resp-<hex>") in the Responses API's spelling ("resp_<hex>").
        response_id = "resp_" + gen.request_id.removeprefix("resp-")
        builder = ResponseBuilder(new_response(req, response_id, serving.model.name,
                                               admitted.sampling))
        reply = ResponsesReply(builder, gen, serving.config.ctx_len)
        return await send_reply(request, [gen], reply, req.stream)
