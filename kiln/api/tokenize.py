"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

/tokenize takes a prompt (`{model?, prompt, add_special_tokens = true, return_token_strs?}`)
or a chat (`{model?, messages, add_generation_prompt = true, continue_final_message?, tools?,
add_special_tokens = false, return_token_strs?}`), rendered exactly as the chat route renders
it, and answers `{count, max_model_len, tokens, token_strs}` (token_strs null unless asked).
/detokenize: `{model?, tokens}` -> `{prompt}`.
"""

from __future__ import annotations

from kiln.api.chat import render_chat
from kiln.api.json_fields import load_json_body, missing, typed
from kiln.api.protocol import parse_chat_request
from kiln.api.state import ServerState
from kiln.api.streaming import json_response
from kiln.runtime.errors import InvalidRequestError


def _read(body: dict, key: str, kind: type, expected: str, default=None):
    v = typed(body, key, kind, expected)
    return default if v is None else v


async def tokenize(request):
    state: ServerState = request.app.ctx.state
    body = load_json_body(request.body)
    strs = _read(body, "return_token_strs", bool, "a boolean", False)
    if "messages" in body:  # the chat form: every check the chat route makes
        add_special = _read(body, "add_special_tokens", bool, "a boolean", False)
        req = parse_chat_request(body)
        await state.ensure_model(req.model)
        add_gen = req.add_generation_prompt if req.add_generation_prompt is not None \
            else not req.continue_final_message
        prompt, _, _ = render_chat(state, req, add_generation_prompt=add_gen)
    else:
        add_special = _read(body, "add_special_tokens", bool, "a boolean", True)
        model = _read(body, "model", str, "a string")
        prompt = _read(body, "prompt", str, "a string")
        if prompt is None:
            raise missing("prompt")
        await state.ensure_model(model)
    tok = state.loaded.tokenizer
    ids = tok.encode(prompt, add_special_tokens=add_special)
    return json_response({"count": len(ids), "max_model_len": state.config.ctx_len,
                          "tokens": ids,
                          "token_strs": [tok.id_to_token(i) for i in ids] if strs else None})


async def detokenize(request):
    state: ServerState = request.app.ctx.state
    body = load_json_body(request.body)
    model = _read(body, "model", str, "a string")
    tokens = _read(body, "tokens", list, "an array of token ids")
    if tokens is None:
        raise missing("tokens")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
        raise InvalidRequestError("Invalid 'tokens': token ids must be non-negative integers.",
                                  param="tokens", code="invalid_value")
    await state.ensure_model(model)
    tok = state.loaded.tokenizer
    if tokens and max(tokens) >= tok.vocab_size:
        raise InvalidRequestError(f"Token id {max(tokens)} is outside the vocabulary (size "
                                  f"{tok.vocab_size}).", param="tokens", code="invalid_value")
    return json_response({"prompt": tok.decode(tokens)})
