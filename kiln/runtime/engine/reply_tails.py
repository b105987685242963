"""The token sequences (prompt + reply) of recently finished requests, so that a request
continuing one of them while its blocks are still cached starts its penalty window with the
end of that reply (contract: "Penalty window and conversations held in the cache")."""

from __future__ import annotations

from collections import OrderedDict

from kiln.runtime.engine.request import Request


class ReplyTails:
    def __init__(self, block_size: int, capacity: int = 256):
        self.block_size, self.capacity = block_size, capacity
        self.entries: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()

    def record(self, req: Request) -> None:
        key = tuple(req.all_token_ids)
        self.entries[key] = list(req.window_token_ids)
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def lookup(self, prompt: list[int], num_cached_tokens: int) -> list[int]:
        best: list[int] = []
        best_len = 0
        for seq, reply in self.entries.items():
            n = len(seq)
            # Its last token was sampled, never computed: its full blocks end before it.
            full = (n - 1) // self.block_size * self.block_size
            if best_len < n < len(prompt) and num_cached_tokens >= full \
                    and tuple(prompt[:n]) == seq:
                best, best_len = reply, n
        return best
