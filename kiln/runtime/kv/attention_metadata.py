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

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
