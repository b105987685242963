"""One sequence fed chunk by chunk through a model's forward, on a private paged KV cache (in
the model backend's layout) whose physical blocks are scrambled, so the forward must follow
the block table."""

from __future__ import annotations

import torch

from kiln.runtime.kv.attention_metadata import AttentionMetadata

BLOCK_SIZE = 16


class PagedSequence:
    def __init__(self, model, max_tokens: int = 1024, seed: int = 0):
        cfg = model.cfg
        num_blocks = -(-max_tokens // BLOCK_SIZE)
        self.model = model
        self.kv = [model.backend.kv_cache(num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
                   for _ in range(cfg.num_layers)]
        self.table = torch.randperm(num_blocks,
                                    generator=torch.Generator().manual_seed(seed)).int()
        self.num_tokens = 0

    def feed(self, ids: list[int], every_position: bool = False) -> torch.Tensor:
        """Logits [vocab] after the last of `ids` ([len(ids), vocab], after each, if
        every_position)."""
        start, end = self.num_tokens, self.num_tokens + len(ids)
        slots = torch.tensor([int(self.table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                              for p in range(start, end)])
        meta = AttentionMetadata(torch.tensor([0, len(ids)], dtype=torch.int32),
                                 torch.tensor([end], dtype=torch.int32),
                                 self.table[None].contiguous(), slots, len(ids), end)
        with torch.inference_mode():
            h = self.model.forward(torch.tensor(ids), torch.arange(start, end), meta, self.kv)
            logits = self.model.compute_logits(h if every_position else h[-1:])
        if not every_position:
            logits = logits[0]
        self.num_tokens = end
        return logits
