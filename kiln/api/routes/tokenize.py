"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

/tokenize takes a prompt (`{model?, prompt, add_special_tokens = true, return_token_strs?}`)
or a chat (`{model?, messages, add_generation_prompt = true, continue_final_message?, tools?,
add_special_tokens = false, return_token_strs?}`), rendered exactly as the chat route renders
it, and answers `{count, max_model_len, tokens, token_strs}` (token_strs null unless asked).
/detokenize: `{model?, tokens}` -> `{prompt}`.
GET /tokenizer_info: the loaded model's tokenizer under tokenizer_config.json's names, as vLLM
answers it. lm-eval's `local-completions` asks for it first: with an answer it tokenizes through
/tokenize and /detokenize; without one it downloads a Hugging Face tokenizer named as the model.
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
    bad,
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


async def tokenizer_info(request):
    state: ServerState = request.app.ctx.state
    for name in request.args:  # vLLM's route takes none: a model chosen here would be ignored
        raise bad(f"Unknown parameter: '{name}'. GET /tokenizer_info takes no parameters; it "
                  "describes the loaded model's tokenizer.", name, "unknown_parameter")
    async with state.use(None) as serving:
        tok, template = serving.model.tokenizer, serving.model.chat_template
        info = {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token,
                "eos_token": tok.eos_token, "pad_token": tok.pad_token,
                "unk_token": tok.unk_token, "add_bos_token": tok.add_bos,
                "add_eos_token": tok.add_eos, "model_max_length": serving.config.ctx_len}
        if template is not None:  # vLLM leaves the key out when there is no template
            info["chat_template"] = template.template_str
        return json_response(info)
