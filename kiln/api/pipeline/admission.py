"""From a checked request to running engine requests: every check that can refuse it first
(the context, the KV pool, the logit_bias ids, the grammar), then the sticky settings'
snapshot, then one engine request per choice. A refused request changes nothing.

A `Generation` is one admitted choice: its engine stream, and the assembler that turns the
stream's tokens into text deltas.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from kiln.api.errors import ServiceUnavailableError
from kiln.api.pipeline.assembler import Delta, OutputAssembler
from kiln.api.state import ServerState, Serving
from kiln.runtime.engine.client import RequestStream
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions, check_fits
from kiln.runtime.errors import ContextLengthError, RequestFailedError
from kiln.runtime.sampling.grammar import GrammarSpec
from kiln.runtime.sampling.params import SamplingParams
from kiln.runtime.sampling.settings import SamplingFields


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def check_prompt_text(serving: Serving, text: str) -> None:
    """The contract's 400 for a prompt text no tokenization could fit in the context (a
    token covers at most max_token_chars characters), before the work of tokenizing it."""
    ctx = serving.config.ctx_len
    if len(text) > ctx * serving.model.tokenizer.max_token_chars:
        raise ContextLengthError(ctx_len=ctx)


@dataclass
class Generation:
    """One admitted choice: its engine stream and the assembler turning it into text."""

    request_id: str
    stream: RequestStream
    assembler: OutputAssembler
    state: ServerState
    serving: Serving

    async def deltas(self) -> AsyncIterator[Delta]:
        finish = "abort"  # until the engine says otherwise (a client that hung up)
        try:
            async for out in self.stream:
                delta = self.assembler.add(out, time.monotonic())
                finish = delta.finish_reason or finish
                if out.finish_reason == "abort" and not self.assembler.stopped \
                        and not self.state.draining:  # shutdown ends a reply as "abort"
                    raise RequestFailedError(self.request_id, "The engine aborted the request.")
                yield delta
                if self.assembler.stopped:  # the engine has ended it too, in the same step
                    if not out.finished:  # (a stop the engine's reading missed)
                        self.serving.engine.abort(self.request_id, reason="stop string")
                    return
        finally:
            self.state.metrics.request_finished(self.assembler.totals, finish)


@dataclass(frozen=True)
class Admitted:
    """What admission decided for every choice of a request."""

    generations: list[Generation]
    sampling: SamplingParams  # the sticky settings' snapshot the request runs with

    @property
    def request_id(self) -> str:
        return self.generations[0].request_id


async def admit(state: ServerState, serving: Serving, prefix: str, prompts: list[list[int]],
                sent: SamplingFields, options: RequestOptions,
                make_assembler: Callable[[], OutputAssembler], *, n: int = 1,
                grammar: GrammarSpec | None = None, grammar_prefix: str = "") -> Admitted:
    """Admit n choices of each prompt (choice p * n + i). Choice i > 0 of a prompt waits for
    choice 0's prefill and reads the prompt's blocks from the prefix cache (it computes no
    prompt logprobs of its own); with a seed, it draws from seed + i, so the n streams differ
    and each repeats."""
    if state.draining:
        raise ServiceUnavailableError()
    for ids in prompts:
        check_fits(serving.config, serving.model.config.vocab_size, len(ids), options)
    if grammar is not None:
        await serving.engine.check_grammar(grammar, grammar_prefix)
    sampling = serving.settings.admit(sent)
    request_id = new_id(prefix)
    gens: list[Generation] = []
    try:
        for p, ids in enumerate(prompts):
            leader = None  # the request id of the prompt's choice 0
            for i in range(n):
                choice = p * n + i
                rid = request_id if choice == 0 else f"{request_id}-{choice}"
                request = EngineRequest(
                    tuple(ids), sampling if i == 0 or sampling.seed is None
                    else replace(sampling, seed=_wrap_int64(sampling.seed + i)),
                    options if i == 0 else replace(options, prompt_logprobs=None),
                    grammar, grammar_prefix, prefill_leader=leader)
                stream = await serving.engine.add_request(rid, request)
                leader = leader or rid
                gens.append(Generation(rid, stream, make_assembler(), state, serving))
    except BaseException:  # the choices already running would otherwise run for no one
        for gen in gens:
            serving.engine.abort(gen.request_id, reason="admission failed")
        raise
    return Admitted(gens, sampling)


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
