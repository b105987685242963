"""The batch's attention metadata: everything the paged attention needs, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, cached + new tokens after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V is stored
    max_query_len: int
    max_seq_len: int
    # Batch-invariant numerics for this forward (EngineConfig.deterministic): every layer
    # computes a token's row the same way whatever else is in the batch.
    deterministic: bool = False
    # The CPU attention's per-forward plan (runtime/cpu_attention.CpuAttentionPlan), built
    # by the first layer that needs it and shared by the rest.
    cpu_plan: object | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
