"""CUDA graphs of the decode forward at bucketed batch sizes.

A decode step of the default model launches ~300 kernels whose launch overhead, at batch 1,
is most of the step. Each bucket's forward is captured once at load and replayed on the
step's inputs, sent in one copy straight into its static buffers (staging.StaticInputs: no
device-to-device copies before a replay). Each bucket has two captures where the context
is longer than one split-KV partition: one for steps whose rows all fit one partition
(attention in one kernel a layer) and one with partitions for the whole context (attention
and the merge of its partials: a kernel more a layer). A row whose keys fit one partition
gets the same bits from either, and from the eager step (kernels/attention.py).

Two families, by the tokens a row brings:
- plain decode (`tokens_per_row` 1): bucket b is b one-token rows; padding rows are sequences
  of one token whose K/V is never stored (slot -1) and whose logits are dropped;
- decode with drafts (`tokens_per_row` 1 + k, --speculative): bucket b holds b rows of up to
  1 + k tokens each, b * (1 + k) + 1 tokens in all, and the logits of every token (a drafted
  row needs each of its positions'). A row brings 1 + its drafts, fewer than 1 + k when it
  drafted less; the tokens left over go to padding sequences after the real ones (one token
  each, the last taking the rest: there is always a last, the one token past b * (1 + k)),
  so the launch's shape (tokens, sequences) is the bucket's whatever the drafts.

Where `with_sampler` is asked (the Triton path), each plain decode capture has the fused
sampler (kernels/sampling.py) captured after it, on its logits, twice: on the rows' nine
per-row columns, and on those and their penalty windows (WINDOW columns, -1 padded). They are
replayed after the forward, with the columns the host built while the forward ran, staged in
one copy (padding rows greedy, every filter off). A step whose rows ask for nothing else -
no logit_bias, grammar, top logprobs or window wider than WINDOW: most steps, the
catalogue's default repeat_last_n being 64 - launches a second graph instead of the
sampler's four kernels with their allocations; the others sample eagerly. The same kernels
on the same rows (a window's -1 columns count nothing): a row's token and logprobs are the
same bits either way.

Off the GPU (the tests) the replays run the same padded forward and sampler eagerly, so the
bucketing, the padding and the static inputs are tested without CUDA.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.kernels.attention import PARTITION_SIZE
from kiln.kernels.sampling import sample
from kiln.kernels.sampling_metadata import SamplerOutput, SamplingMetadata
from kiln.runtime.engine.staging import SAMPLER_FIELDS, SamplerInputs, StepInputs
from kiln.runtime.kv.attention_metadata import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WINDOW = 64  # penalty window columns the graphs' sampler reads (the default repeat_last_n)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The buckets a batch of up to max_num_seqs decodes pads to (the last holds them all)."""
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    return sizes + [next((b for b in BUCKETS if b >= max_num_seqs), max_num_seqs)]


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, ctx_len: int, block_size: int,
                 device: torch.device, tokens_per_row: int = 1, with_sampler: bool = False):
        """with_sampler: plain decode buckets' samplers captured too (the Triton path)."""
        self.model, self.kv_caches, self.ctx_len = model, kv_caches, ctx_len
        self.tokens_per_row = tokens_per_row
        self.with_sampler = with_sampler and tokens_per_row == 1
        self.sizes = bucket_sizes(max_num_seqs)
        T, S = self.shape(self.sizes[-1])
        max_blocks = -(-ctx_len // block_size)
        # One set of static inputs at the largest bucket (bucket b uses the first rows).
        self.inputs = StepInputs(device, T, S, max_blocks)
        t = self.inputs.tensors
        self.input_ids, self.positions, self.slot_mapping = \
            t["input_ids"], t["positions"], t["slot_mapping"]
        self.seq_lens, self.query_start_loc, self.block_tables = \
            t["seq_lens"], t["query_start_loc"], t["block_tables"]
        self.slot_mapping.fill_(-1)  # what the captures run on: sequences that store nothing
        self.seq_lens.fill_(1)
        self.query_start_loc.copy_(torch.arange(S + 1, dtype=torch.int32))
        # The contexts a capture covers: one partition, and the whole context where longer.
        self.spans = sorted({min(ctx_len, PARTITION_SIZE), ctx_len})
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bucket, span)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._logits: torch.Tensor | None = None  # the last replay's, all its rows
        # The samplers: with the rows' values ("plain"), and with their windows too
        self.variants = ("plain", "penalties") if self.with_sampler else ()
        self.sampler_inputs = SamplerInputs(device, S, WINDOW) if self.with_sampler else None
        # The samples, outside the graphs' pool: a row's token in flight (--async-scheduling)
        # is read into the next step's penalty window after that step's forward has replayed,
        # which may write over the pool's memory (capture's docstring).
        i64, f32 = (dict(dtype=dt, device=device) for dt in (torch.int64, torch.float32))
        self.samples = SamplerOutput(torch.zeros(S, **i64), torch.zeros(S, **f32),
                                     torch.zeros(S, 0, **i64), torch.zeros(S, 0, **f32))
        # (bucket, span, variant) -> the sampler's graph and its samples
        self.sampler_graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph] = {}
        self.sampled: dict[tuple[int, int, str], SamplerOutput] = {}

    def shape(self, b: int) -> tuple[int, int]:
        """(tokens, sequences) of bucket b's launch."""
        if self.tokens_per_row == 1:
            return b, b
        return b * self.tokens_per_row + 1, b + 1

    def bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.sizes if b >= num_seqs), None)

    def pad(self, b: int, input_ids: np.ndarray, positions: np.ndarray,
            slot_mapping: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray,
            block_tables: np.ndarray) -> tuple[np.ndarray, ...]:
        """The step's inputs padded to bucket b's shape with sequences that store nothing."""
        T, S = self.shape(b)
        real_tokens, real_seqs = len(input_ids), len(seq_lens)
        if (real_tokens, real_seqs) == (T, S):  # a batch of the bucket's size: nothing to add
            return input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables
        lengths = np.ones(S - real_seqs, dtype=np.int32)  # the padding sequences' tokens
        lengths[-1:] += T - real_tokens - len(lengths)
        local = np.arange(T - real_tokens) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return (np.concatenate([input_ids, np.zeros(T - real_tokens, dtype=np.int64)]),
                np.concatenate([positions, local]),  # each padding sequence from position 0
                np.pad(slot_mapping, (0, T - real_tokens), constant_values=-1),
                np.concatenate([query_start_loc,
                                real_tokens + np.cumsum(lengths, dtype=np.int32)]),
                np.concatenate([seq_lens, lengths]),
                np.pad(block_tables, ((0, S - real_seqs), (0, 0))))

    def span(self, max_seq_len: int) -> int:
        """The capture a step whose longest row has max_seq_len positions replays."""
        return next(s for s in self.spans if s >= max_seq_len)

    def _forward(self, b: int, span: int) -> torch.Tensor:  # [tokens or b, vocab] logits
        T, S = self.shape(b)
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[:S + 1], seq_lens=self.seq_lens[:S],
            block_tables=self.block_tables[:S], slot_mapping=self.slot_mapping[:T],
            max_query_len=T - S + 1, max_seq_len=span)
        hidden = self.model.forward(self.input_ids[:T], self.positions[:T], meta,
                                    self.kv_caches)
        return self.model.compute_logits(hidden)

    def _sample(self, logits: torch.Tensor, b: int, variant: str) -> SamplerOutput:
        """Bucket b's rows sampled from their staged columns (and windows), every kernel
        launched (greedy rows are settled in the second, whatever the batch)."""
        t = self.sampler_inputs.tensors
        columns = [t[name][:b] for name, _, _ in SAMPLER_FIELDS]
        window = self.sampler_inputs.window[:b] if variant == "penalties" else None
        meta = SamplingMetadata(*columns[:7], window_token_ids=window, seeds=columns[7],
                                offsets=columns[8], grammar_bitmask=None,
                                flags=(True, True, True, False))
        return sample(logits, meta, out=SamplerOutput(*(
            x[:b] for x in (self.samples.token_ids, self.samples.logprobs,
                            self.samples.top_token_ids, self.samples.top_logprobs))))

    @torch.inference_mode()
    def capture(self, pool=None):
        """Largest bucket first, all in one memory pool (a smaller graph reuses its memory;
        pool: another family's, shared) -> the pool. A graph's intermediates may lie where
        a graph captured after it holds its logits: read before the next forward replays, so
        safe; the samples, read after it at times, are not the pool's."""
        def captured(run, *args):
            run(*args)  # eagerly first: lazy initialisations stay out
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run(*args)
            return graph, out

        for b in reversed(self.sizes):
            for span in reversed(self.spans):
                graph, self.outputs[b, span] = captured(self._forward, b, span)
                self.graphs[b, span], pool = graph, graph.pool()
                for variant in self.variants:
                    self.sampler_graphs[b, span, variant], self.sampled[b, span, variant] = \
                        captured(self._sample, self.outputs[b, span], b, variant)
        return pool

    def stage(self, b: int, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Inputs padded to bucket b by `pad`, and the logits rows -> the static tensors
        holding them, sent in one copy (StepInputs.stage)."""
        assert len(arrays[0]) == self.shape(b)[0]
        return self.inputs.stage(*arrays)

    @torch.inference_mode()
    def replay(self, b: int, max_seq_len: int) -> torch.Tensor:
        """Bucket b's capture for contexts up to max_seq_len, on the inputs `stage` sent ->
        logits of its rows (plain decode) or of its tokens (with drafts): a static buffer,
        valid until the next replay."""
        span = self.span(max_seq_len)
        graph = self.graphs.get((b, span))
        if graph is None:  # not captured (no CUDA): the same padded forward, eagerly
            self._logits = self._forward(b, span)
        else:
            graph.replay()
            self._logits = self.outputs[b, span]
        return self._logits

    @torch.inference_mode()
    def sample_rows(self, b: int, max_seq_len: int, columns: list[np.ndarray],
                    window: np.ndarray | None, fill=None) -> SamplerOutput:
        """The sampler's capture after the last replay (bucket b, contexts up to
        max_seq_len), on the rows' columns and windows staged in one copy -> the bucket's
        samples (static buffers, valid until the next): with window, the "penalties"
        variant. fill: called with the staged windows before the replay (the tokens in
        flight)."""
        self.sampler_inputs.stage(columns, b, window)
        if fill is not None:
            fill(self.sampler_inputs.window)
        key = (b, self.span(max_seq_len), "plain" if window is None else "penalties")
        graph = self.sampler_graphs.get(key)
        if graph is None:  # (no CUDA) eagerly, on the padded rows as captured
            return self._sample(self._logits, b, key[2])
        graph.replay()
        return self.sampled[key]
