"""Piecewise CUDA graphs: a prefill or mixed step's token-wise work replayed, attention eager.

The decode graphs (cuda_graphs.py) serve steps of one-token rows only. A step that brings a
prompt chunk - the step after every new request, where the running rows' decode waits on it -
ran eagerly: ~10 launches a layer from Python. vLLM's answer, taken here: the forward cut at
its attentions (models/decoder.py's pieces), each piece between two attentions captured per
token bucket, attention launched eagerly between replays, because its grid and metadata
follow the step's sequences, not only its token count. Everything else is token by token,
the KV store too (a token's slot and position are its own), so a layer is one replay and
its attention's launch (and the merge of its partitions where split).

A step of T tokens replays bucket b >= T: the pieces run on b rows, the padding rows with
id 0, position 0 and slot -1 (their K/V is stored nowhere; a row's products never read
another row's), attention and the logits take only the T real rows. The step's arrays are
staged straight into the graphs' inputs (staging.StepInputs: one copy); the attention output
is a buffer of the largest bucket; the residual stream and each piece's output are the
captured tensors, held.

Only steps up to MAX_TOKENS: vLLM's default capture limit; past it a step's kernels are long
enough that their launches overlap them. Off the GPU (the tests) the pieces run eagerly on
the same padded buffers, so the bucketing, the padding and the buffers are tested without
CUDA.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.runtime.engine.staging import StepInputs
from kiln.runtime.kv.attention_metadata import AttentionMetadata

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)
MAX_TOKENS = TOKEN_BUCKETS[-1]


class PiecewiseGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, ctx_len: int, block_size: int,
                 device: torch.device, max_tokens: int):
        self.model, self.kv_caches = model, kv_caches
        # up to the bucket that holds the engine's largest step, if one does
        self.sizes = [b for b in TOKEN_BUCKETS if b < max_tokens] + \
            [b for b in TOKEN_BUCKETS if b >= max_tokens][:1]
        cfg, T = model.cfg, self.sizes[-1]
        self.inputs = StepInputs(device, T, min(max_num_seqs, T), -(-ctx_len // block_size))
        t = self.inputs.tensors
        self.input_ids, self.positions, self.slot_mapping = \
            t["input_ids"], t["positions"], t["slot_mapping"]
        self.slot_mapping.fill_(-1)  # what the captures run on: tokens that store nothing
        self.attn = torch.zeros(T, cfg.num_heads * cfg.head_dim, dtype=model.backend.dtype,
                                device=device)
        self.num_pieces = cfg.num_layers + 1  # before the first attention, after each
        # bucket -> the residual stream, then each piece's output (a layer's rotated
        # queries; the last: the final hidden states), and the pieces' graphs where captured
        self.stream: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.sizes if b >= num_tokens), None)

    def stage(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
              *rest: np.ndarray) -> list[torch.Tensor]:
        """A step's arrays (as StepInputs.stage takes them), its tokens' padded to its bucket,
        -> the static tensors holding them (the tokens' real rows), sent in one copy."""
        T = len(input_ids)
        pad = (0, self.bucket(T) - T)
        sent = self.inputs.stage(np.pad(input_ids, pad), np.pad(positions, pad),
                                 np.pad(slot_mapping, pad, constant_values=-1), *rest)
        return [x[:T] for x in sent[:3]] + sent[3:]

    def _piece(self, b: int, i: int) -> torch.Tensor:
        """Piece i of bucket b on its buffers: the embedding and the first layer up to its
        attention (i 0), layer i - 1 from its attention's output to layer i's attention, or
        the last layer's rest (i num_layers)."""
        model = self.model
        if i == 0:
            self.stream[b] = model.embed_tokens(self.input_ids[:b])
            out = model.first_projection(self.stream[b])
        else:
            out = model.after_attention(i - 1, self.stream[b], self.attn[:b])
        if i == self.num_pieces - 1:
            return out
        return model.rope_store_kv(i, out, self.positions[:b], self.slot_mapping[:b],
                                   self.kv_caches[i])

    @torch.inference_mode()
    def capture(self, pool=None):
        """Largest bucket first, all in one memory pool (pool: to share the decode graphs');
        each piece run eagerly once first, so lazy initialisations stay out (on tokens that
        store nothing). -> the pool.
        A graph's intermediates may lie where a graph captured after it holds an output: safe,
        since within a step every output is written by its own replay before it is read."""
        for b in reversed(self.sizes):
            graphs, outputs = [], []
            for i in range(self.num_pieces):
                self._piece(b, i)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs.append(self._piece(b, i))
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[b], self.outputs[b] = graphs, outputs
        return pool

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """The model's forward on a step `stage` sent (input_ids and positions are its views:
        the pieces read the padded buffers) -> its hidden states [T, hidden]: a static
        buffer, valid until the next replay."""
        T = input_ids.shape[0]
        assert input_ids.data_ptr() == self.input_ids.data_ptr() and kv_caches is self.kv_caches
        b = self.bucket(T)
        graphs = self.graphs.get(b)
        out = None
        for i in range(self.num_pieces):
            if i:
                self.model.attend(i - 1, out[:T], meta, kv_caches[i - 1], out=self.attn[:T])
            if graphs is None:  # not captured (no CUDA): the same piece, eagerly
                out = self._piece(b, i)
            else:
                graphs[i].replay()
                out = self.outputs[b][i]
        return out[:T]
