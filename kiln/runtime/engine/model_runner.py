"""Turns a SchedulerOutput into one batched forward: packs tokens, positions, the slot
mapping and block tables, runs the model, and returns the logits of rows that sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.request import Request
from kiln.runtime.kv.attention_metadata import AttentionMetadata
from kiln.runtime.kv.kv_cache_manager import KVCacheManager
from kiln.runtime.models.config import ModelConfig


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S'] rows whose next token is sampled
    sampling_requests: list[Request]  # the S' requests, in the same order


class ModelRunner:
    def __init__(self, model, model_config: ModelConfig, config: EngineConfig,
                 kv_manager: KVCacheManager):
        self.model, self.model_config, self.config = model, model_config, config
        self.kv = kv_manager
        backend = model.backend
        self.device = backend.device
        mc = model_config
        # One (key, value) pair per layer, in the backend's layout.
        self.kv_caches = [backend.kv_cache(config.num_blocks, config.block_size,
                                           mc.num_kv_heads, mc.head_dim)
                          for _ in range(mc.num_layers)]

    def prepare(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        bs = self.config.block_size
        input_ids, positions, slots = [], [], []
        query_start_loc, seq_lens, tables = [0], [], []
        logits_indices, sampling_requests = [], []
        for req, n in scheduled:
            start = req.num_computed_tokens
            block_ids = self.kv.get_block_ids(req)
            input_ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            tables.append(block_ids)
            if start + n == req.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                sampling_requests.append(req)
        width = max(len(t) for t in tables)
        table = torch.zeros((len(tables), width), dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(n for _, n in scheduled),
            max_seq_len=max(seq_lens),
        )
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            sampling_requests=sampling_requests,
        )

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor | None:
        """Logits [S', vocab] fp32 for the rows that sample, or None if none do."""
        hidden = self.model.forward(inp.input_ids, inp.positions, inp.meta, self.kv_caches)
        if not inp.sampling_requests:
            return None
        return self.model.compute_logits(hidden[inp.logits_indices])
