"""Piecewise CUDA graphs: a prefill or mixed step's dense work replayed, its attention eager.

The decode graphs (cuda_graphs.py) serve steps of one-token rows only. A step that brings a
prompt chunk - the step after every new request, where the running rows' decode waits on it -
ran eagerly: ~10 launches a layer from Python. vLLM's answer, taken here: the forward cut at
its attentions (models/decoder.py's pieces), each piece between two attentions captured per
token bucket, attention launched eagerly between replays, because its grid and metadata
follow the step's sequences, not only its token count. A layer is then one replay and its
attention's launches (RoPE with the KV store, the attention, the merge where split).

A step of T tokens replays bucket b >= T: the pieces run on b rows, the padding rows'
tokens embedded like any (their ids are whatever the buffer held: a row's products never
read another row's), attention and the logits take only the T real rows. Each piece reads
its inputs from fixed addresses: the input ids and the attention output are buffers of the
largest bucket; the residual stream and each piece's output are the captured tensors, held.

Only steps up to MAX_TOKENS: vLLM's default capture limit; past it a step's kernels are long
enough that their launches overlap them. Off the GPU (the tests) the pieces run eagerly on
the same padded buffers, so the bucketing, the padding and the buffers are tested without
CUDA.
"""

from __future__ import annotations

import torch

from kiln.runtime.kv.attention_metadata import AttentionMetadata

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)
MAX_TOKENS = TOKEN_BUCKETS[-1]


class PiecewiseGraphs:
    def __init__(self, model, max_tokens: int, device: torch.device):
        self.model = model
        # up to the bucket that holds the engine's largest step, if one does
        self.sizes = [b for b in TOKEN_BUCKETS if b < max_tokens] + \
            [b for b in TOKEN_BUCKETS if b >= max_tokens][:1]
        cfg, T = model.cfg, self.sizes[-1]
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=device)
        self.attn = torch.zeros(T, cfg.num_heads * cfg.head_dim, dtype=model.backend.dtype,
                                device=device)
        self.num_pieces = cfg.num_layers + 1  # before the first attention, after each
        # bucket -> the residual stream, then each piece's output (a QKV product; the
        # last: the final hidden states), and the pieces' graphs where captured
        self.stream: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.sizes if b >= num_tokens), None)

    def _piece(self, b: int, i: int) -> torch.Tensor:
        """Piece i of bucket b on its buffers: the embedding and the first QKV product (i 0),
        or layer i - 1 from its attention's output on."""
        if i == 0:
            self.stream[b] = self.model.embed_tokens(self.input_ids[:b])
            return self.model.first_projection(self.stream[b])
        return self.model.after_attention(i - 1, self.stream[b], self.attn[:b])

    @torch.inference_mode()
    def capture(self, pool=None):
        """Largest bucket first, all in one memory pool (pool: to share the decode graphs');
        each piece run eagerly once first, so lazy initialisations stay out. -> the pool.
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
        """The model's forward for a step of up to the largest bucket's tokens -> its hidden
        states [T, hidden]: a static buffer, valid until the next replay."""
        T = input_ids.shape[0]
        b = self.bucket(T)
        self.input_ids[:T].copy_(input_ids)
        graphs = self.graphs.get(b)
        out = None
        for i in range(self.num_pieces):
            if i:
                self.model.attend(i - 1, out[:T], positions, meta, kv_caches[i - 1],
                                  out=self.attn[:T])
            if graphs is None:  # not captured (no CUDA): the same piece, eagerly
                out = self._piece(b, i)
            else:
                graphs[i].replay()
                out = self.outputs[b][i]
        return out[:T]
