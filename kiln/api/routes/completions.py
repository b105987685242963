"""POST /v1/completions: a text_completion body, or its chunks as SSE. Each prompt runs n
choices; choice c answers prompt c // n. With echo, a choice's text starts with its prompt
(and, with logprobs, its entries with the prompt's, computed by the prompt's choice 0)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.api.pipeline.admission import Generation, admit, check_prompt_text
from kiln.api.pipeline.assembler import Delta, OutputAssembler
from kiln.api.pipeline.openai_reply import OpenAIReply
from kiln.api.pipeline.reply import send_reply
from kiln.api.pipeline.workers import off_loop, read_body
from kiln.api.protocol.completions import CompletionRequest, parse_completion_request
from kiln.api.protocol.fields import check_vocabulary
from kiln.api.state import ServerState, Serving
from kiln.runtime.errors import InvalidRequestError


def prompt_ids(serving: Serving, prompt: str | tuple[int, ...]) -> tuple[list[int], str]:
    """(token ids, text) of one prompt: text is tokenized, ids are checked and decoded.
    Blocking (a long prompt takes seconds), so off the event loop."""
    tok = serving.model.tokenizer
    if isinstance(prompt, str):
        check_prompt_text(serving, prompt)
        ids = tok.encode(prompt, add_special_tokens=True)
        if not ids:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        return ids, prompt
    check_vocabulary(prompt, tok.vocab_size, "prompt")
    return list(prompt), tok.decode(list(prompt))


def completion_logprobs(entries: list[dict], text_offset: int) -> dict:
    """/v1/completions' legacy logprobs shape from chat-style entries (an echoed prompt's
    first token has logprob and top_logprobs None: nothing precedes it)."""
    tokens, offsets, offset = [], [], text_offset
    for e in entries:
        tokens.append(e["token"])
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                         if e["top_logprobs"] is not None else None for e in entries],
        "text_offset": offsets,
    }


@dataclass
class _Choice:
    started: bool = False
    offset: int = 0  # characters sent so far (the stream's text_offset)
    text: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    finish_reason: str | None = None


class CompletionReply(OpenAIReply):
    object = chunk_object = "text_completion"

    def __init__(self, req: CompletionRequest, gens: list[Generation],
                 prompts: list[tuple[list[int], str]], serving: Serving):
        super().__init__(gens, req.n, req.include_usage, serving)
        self.req, self.prompts = req, prompts
        self.logprobs = req.options.logprobs is not None
        self.choices = [_Choice() for _ in gens]
        # Each prompt's echoed entries, from its choice 0's first delta (None until then).
        self.prompt_entries: list[list[dict] | None] = [None for _ in prompts]
        # A later choice's deltas, held until its prompt's entries are known: its echo
        # carries them, whichever choice's tokens reach the server first.
        self.held: dict[int, list[Delta]] = {}

    def _echo(self, c: int) -> tuple[str, list[dict]]:
        """What choice c's text and entries start with."""
        if not self.req.echo:
            return "", []
        p = c // self.n
        return self.prompts[p][1], self.prompt_entries[p] or []

    def _choice(self, c: int, text: str, entries: list[dict], finish, offset: int) -> dict:
        return {"index": c, "text": text, "finish_reason": finish,
                "logprobs": completion_logprobs(entries, offset) if self.logprobs else None}

    def start(self) -> list[dict]:
        return []

    def feed(self, c: int, d: Delta) -> list[dict]:
        p = c // self.n
        if d.prompt_logprobs is not None:
            first = {"token": self.gens[c].assembler.detok.token_text(self.prompts[p][0][0]),
                     "logprob": None, "top_logprobs": None}
            self.prompt_entries[p] = [first] + d.prompt_logprobs[1:]
        if self.req.options.prompt_logprobs is not None and self.prompt_entries[p] is None:
            self.held.setdefault(c, []).append(d)
            return []
        events = self._feed(c, d)
        for sibling in range(p * self.n, (p + 1) * self.n):
            for held in self.held.pop(sibling, []) if self.prompt_entries[p] else []:
                events += self._feed(sibling, held)
        return events

    def _feed(self, c: int, d: Delta) -> list[dict]:
        ch = self.choices[c]
        ch.text.append(d.content)
        ch.entries += d.logprobs
        ch.finish_reason = d.finish_reason or ch.finish_reason
        text, entries = d.content, d.logprobs
        if not ch.started:  # the echo goes out with the choice's first delta
            ch.started = True
            head_text, head_entries = self._echo(c)
            text, entries = head_text + text, head_entries + entries
        if not (text or entries or d.finish_reason):
            return []
        chunk = self.chunk([self._choice(c, text, entries, d.finish_reason, ch.offset)])
        ch.offset += len(text)
        return [chunk]

    def finish(self) -> list[dict]:
        # (Held deltas whose prompt never got its entries: the first choice failed.)
        events = [e for c, held in sorted(self.held.items()) for d in held
                  for e in self._feed(c, d)]
        self.held.clear()
        return events + super().finish()

    def body(self) -> dict:
        choices = []
        for c, ch in enumerate(self.choices):
            head_text, head_entries = self._echo(c)
            choices.append(self._choice(c, head_text + "".join(ch.text),
                                        head_entries + ch.entries, ch.finish_reason, 0))
        return self.whole(choices)


async def completions(request):
    state: ServerState = request.app.ctx.state
    req = await read_body(request, parse_completion_request)
    async with state.use(req.model) as serving:
        tok = serving.model.tokenizer
        prompts = await off_loop(lambda: [prompt_ids(serving, p) for p in req.prompts])
        style = "completions" if req.options.logprobs is not None else None
        admitted = await admit(state, serving, "cmpl", [ids for ids, _ in prompts],
                               req.sampling, req.options,
                               lambda: OutputAssembler(tok, stop=list(req.options.stop),
                                                       logprobs_style=style), n=req.n)
        reply = CompletionReply(req, admitted.generations, prompts, serving)
        return await send_reply(request, admitted.generations, reply, req.stream)
