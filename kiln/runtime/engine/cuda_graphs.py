"""CUDA graphs of the decode forward at bucketed batch sizes.

A decode step of the default model launches ~500 kernels whose launch overhead, at batch 1,
is most of the step. Each bucket's forward (one token per sequence, batch padded to the
bucket) is captured once at load and replayed with the step's inputs copied into its static
buffers. Padding rows are sequences of one token whose K/V is never stored (slot -1) and
whose logits are dropped; attention always takes its split-KV variant with partitions for
the whole context, which gives a row the same bits as the eager step (kernels/attention.py).

Off the GPU (the tests) `replay` runs the same padded forward eagerly, so the bucketing and
the static inputs are tested without CUDA.
"""

from __future__ import annotations

import torch

from kiln.runtime.kv.attention_metadata import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The buckets a batch of up to max_num_seqs decodes pads to (the last holds them all)."""
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    return sizes + [next((b for b in BUCKETS if b >= max_num_seqs), max_num_seqs)]


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, ctx_len: int, block_size: int,
                 device: torch.device):
        self.model, self.kv_caches, self.ctx_len = model, kv_caches, ctx_len
        self.sizes = bucket_sizes(max_num_seqs)
        B, max_blocks = self.sizes[-1], -(-ctx_len // block_size)
        # One set of static inputs at the largest bucket; bucket b uses the first b rows.
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=device)
        self.positions = torch.zeros(B, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((B, max_blocks), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.sizes if b >= num_seqs), None)

    def _forward(self, b: int) -> torch.Tensor:  # [b, vocab] logits
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
            max_query_len=1, max_seq_len=self.ctx_len)
        hidden = self.model.forward(self.input_ids[:b], self.positions[:b], meta,
                                    self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, all in one memory pool (a smaller graph reuses its memory)."""
        pool = None
        for b in reversed(self.sizes):
            self._forward(b)  # an eager run first: lazy initialisations stay out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               b: int) -> torch.Tensor:
        """Inputs padded to bucket b by the runner -> logits [b, vocab] (a static buffer,
        valid until the next replay). Stale block-table columns past this step's width are
        never read: a row reads only the blocks its seq_len covers."""
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        graph = self.graphs.get(b)
        if graph is None:  # not captured (no CUDA): the same padded forward, eagerly
            return self._forward(b)
        graph.replay()
        return self.outputs[b]
