"""POST /v1/responses: OpenAI's Responses API (what Codex-style agents speak) on the chat
pipeline. The body is read into a chat request (openai_responses_input), run as the chat
route runs it (same grammar, sampler, sticky settings and 400s, all decided before a stream
starts), and the deltas are written out as a Response object or its SSE events
(openai_responses_output)."""

from __future__ import annotations

import logging

from kiln.api.chat import Generation, prepare_chat
from kiln.api.json_fields import load_json_body
from kiln.api.openai_responses_input import parse_responses_request
from kiln.api.openai_responses_output import ResponseBuilder, new_response, responses_usage
from kiln.api.responses import usage
from kiln.api.state import ServerState
from kiln.api.streaming import json_response, send_sse
from kiln.runtime.errors import KilnError

log = logging.getLogger("kiln")


async def create_response(request):
    state: ServerState = request.app.ctx.state
    req = parse_responses_request(load_json_body(request.body))
    job = await prepare_chat(state, req.chat)
    gen = job.submit(state, "resp")
    # The engine's id ("resp-<hex>") in the Responses API's spelling ("resp_<hex>").
    response_id = "resp_" + gen.request_id.removeprefix("resp-")
    builder = ResponseBuilder(new_response(req, response_id, state.loaded.name,
                                           gen.stream.request.sampling))
    if req.stream:
        return await send_sse(request, _events(gen, builder), done=False,
                              event_name=lambda event: event["type"])
    async for d in gen.deltas():
        builder.feed(d)
    builder.finish(_usage(gen))
    return json_response(builder.response)


def _usage(gen: Generation) -> dict:
    return responses_usage(usage(gen.assembler.totals, gen.state.config.ctx_len))


async def _events(gen: Generation, builder: ResponseBuilder):
    """Every event of the stream; a failure after it started ends it in-band (`error`, then
    `response.failed`), never with a hang or a cut connection."""
    for event in builder.start():
        yield event
    try:
        async for d in gen.deltas():
            for event in builder.feed(d):
                yield event
        final = builder.finish(_usage(gen))
    except KilnError as exc:  # an engine abort (InternalServerError) and its kin
        final = builder.fail(exc.message)
    except Exception as exc:  # a bug: logged with its traceback, reported by request id
        log.error("[kiln]  Internal error in request %s", gen.request_id, exc_info=exc)
        final = builder.fail(f"The server had an error while processing request "
                             f"{gen.request_id}.")
    for event in final:
        yield event
