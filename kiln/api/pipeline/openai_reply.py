"""What /v1/chat/completions' and /v1/completions' replies share: one id, creation time and
system fingerprint (what decides the reply's bits: the Serving's) for every chunk and the
whole body, the usage chunk last when asked, an error in-band, and the whole body's envelope.
Each route's reply adds its choices."""

from __future__ import annotations

import time

from kiln.api.errors import error_body
from kiln.api.pipeline.admission import Generation
from kiln.api.pipeline.assembler import combined_totals
from kiln.api.pipeline.usage import usage
from kiln.api.state import Serving
from kiln.runtime.errors import KilnError


class OpenAIReply:
    framing = "sse"
    object = ""  # the whole body's; a chunk's is chunk_object
    chunk_object = ""

    def __init__(self, gens: list[Generation], n: int, include_usage: bool,
                 serving: Serving):
        self.gens, self.n, self.include_usage = gens, n, include_usage
        self.model, self.ctx_len = serving.model.name, serving.config.ctx_len
        self.id, self.created = gens[0].request_id, int(time.time())
        self.fingerprint = serving.fingerprint

    def usage(self) -> dict:
        return usage(combined_totals([g.assembler.totals for g in self.gens], self.n),
                     self.ctx_len)

    def chunk(self, choices: list[dict]) -> dict:
        c = {"id": self.id, "object": self.chunk_object, "created": self.created,
             "model": self.model, "system_fingerprint": self.fingerprint, "choices": choices}
        if self.include_usage:
            c["usage"] = None
        return c

    def finish(self) -> list[dict]:
        if not self.include_usage:
            return []
        last = self.chunk([])
        last["usage"] = self.usage()
        return [last]

    def fail(self, exc: KilnError) -> list[dict]:
        return [error_body(exc)]

    def whole(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint,
                "choices": choices, "usage": self.usage()}
