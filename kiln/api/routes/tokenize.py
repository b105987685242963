"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

/tokenize takes a prompt (`{model?, prompt, add_special_tokens = true, return_token_strs?}`)
or a chat (`{model?, messages, add_generation_prompt = true, continue_final_message?, tools?,
add_special_tokens = false, return_token_strs?}`), rendered exactly as the chat route renders
it, and answers `{count, max_model_len, tokens, token_strs}` (token_strs null unless asked).
/detokenize: `{model?, tokens}` -> `{prompt}`.
"""

from __future__ import annotations

import json

from sanic.response import raw

from kiln.api.pipeline.chat import render_chat
from kiln.api.pipeline.reply import json_response
from kiln.api.pipeline.workers import off_loop, read_body
from kiln.api.protocol.chat import parse_chat_request
from kiln.api.protocol.fields import (
    as_token_ids,
    check_vocabulary,
    missing,
    typed,
)
from kiln.api.state import ServerState, Serving


def _read(body: dict, key: str, kind: type, expected: str, default=None):
    v = typed(body, key, kind, expected)
    return default if v is None else v


async def tokenize(request):
    state: ServerState = request.app.ctx.state
    body = await read_body(request)
    strs = _read(body, "return_token_strs", bool, "a boolean", False)
    chat = parse_chat_request(body) if "messages" in body else None  # every chat check
    add_special = _read(body, "add_special_tokens", bool, "a boolean", chat is None)
    if chat is None:
        model = _read(body, "model", str, "a string")
        prompt = _read(body, "prompt", str, "a string")
        if prompt is None:
            raise missing("prompt")
    else:
        model, prompt = chat.model, None

    def answer(serving: Serving) -> str:  # blocking: a long prompt takes seconds
        text = prompt
        if chat is not None:
            add_gen = chat.add_generation_prompt if chat.add_generation_prompt is not None \
                else not chat.continue_final_message
            text, _, _ = render_chat(serving, chat, add_generation_prompt=add_gen)
        tok = serving.model.tokenizer
        ids = tok.encode(text, add_special_tokens=add_special)
        head = json.dumps({"count": len(ids), "max_model_len": serving.config.ctx_len})
        strs_json = json_array([tok.id_to_token(i) for i in ids]) if strs else "null"
        return f'{head[:-1]}, "tokens": {json_array(ids)}, "token_strs": {strs_json}}}'


    async with state.use(model) as serving:
        return raw(await off_loop(answer, serving), content_type="application/json")


def json_array(values: list, chunk: int = 1 << 16) -> str:
    """A JSON array written a slice at a time: a million ids in one call would hold the
    interpreter (and the event loop with it) for a quarter of a second."""
    return "[" + ", ".join(json.dumps(values[i:i + chunk])[1:-1]
                           for i in range(0, len(values), chunk) if values[i:i + chunk]) + "]"


async def detokenize(request):
    state: ServerState = request.app.ctx.state
    body = await read_body(request)
    model = _read(body, "model", str, "a string")
    tokens = _read(body, "tokens", list, "an array of token ids")
    if tokens is None:
        raise missing("tokens")
    tokens = as_token_ids(tokens, "tokens")
    async with state.use(model) as serving:
        tok = serving.model.tokenizer
        check_vocabulary(tokens, tok.vocab_size, "tokens")
        return json_response({"prompt": await off_loop(tok.decode, list(tokens))})
