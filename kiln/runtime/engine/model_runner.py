"""Turns a SchedulerOutput into one batched forward: packs tokens, positions, the slot
mapping and block tables (one host-to-device copy), runs the model, and returns the logits of
rows that sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kiln.kernels.sampling_metadata import SamplerOutput
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.cuda_graphs import WINDOW, DecodeGraphs
from kiln.runtime.engine.piecewise_graphs import PiecewiseGraphs
from kiln.runtime.engine.request import InFlightTokens, Request, TokenLogprob
from kiln.runtime.engine.staging import StagingBuffer
from kiln.runtime.kv.attention_metadata import AttentionMetadata
from kiln.runtime.kv.kv_cache_manager import KVCacheManager
from kiln.runtime.models.config import ModelConfig
from kiln.runtime.sampling.sampler import (
    SamplerColumns,
    cpu_draw_for,
    fill_in_flight,
    raw_logprobs,
)


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S'] rows whose next token is sampled (or checked)
    sampling_requests: list[Request]  # the requests those rows are of, in the same order
    # Logits rows per sampling request: 1, or 1 + its drafts (the row before each draft,
    # and the last one, which yields the token after the drafts).
    num_logits_rows: list[int] = field(default_factory=list)
    graphs: DecodeGraphs | None = None  # a decode (with drafts or not) through these ...
    graph_bucket: int | None = None  # ... padded to this bucket
    pieces: PiecewiseGraphs | None = None  # any other step through these, if it fits
    # (request, first row, first position, end position): rows whose logits give the
    # logprobs of the prompt tokens at positions first + 1 .. end (completions' echo).
    prompt_logprob_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)

PROMPT_LOGPROB_ROWS = 256  # logits rows materialised at once for prompt logprobs


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
        self.staging = StagingBuffer(self.device)
        self.scatter_staging = StagingBuffer(self.device, capacity=1 << 12)  # in-flight rows
        self.cpu_draw = cpu_draw_for(self.device, config.use_triton)  # for prompt logprobs
        self._threads_set = False
        self.graphs = self.spec_graphs = self.pieces = None
        if config.cuda_graphs:
            args = (model, self.kv_caches, config.max_num_seqs, config.ctx_len,
                    config.block_size, self.device)
            self.graphs = DecodeGraphs(*args, with_sampler=config.use_triton)
            self.pieces = PiecewiseGraphs(*args, max_tokens=config.token_budget)
            if config.speculative is not None:  # rows of 1 + their drafts
                self.spec_graphs = DecodeGraphs(
                    *args, tokens_per_row=1 + config.speculative.num_speculative_tokens)

    def prepare(self, scheduled: list[tuple[Request, int]],
                in_flight: InFlightTokens | None = None) -> ModelInput:
        """The step's inputs, built in work proportional to its tokens and rows, not to its
        contexts: positions, slots and lengths by numpy over the whole step, block tables
        in one gather of the KV manager's rows. A row whose last token is still in flight
        (--async-scheduling) takes it from the device, where the last step sampled it."""
        bs = self.config.block_size
        num_seqs = len(scheduled)
        reqs = [req for req, _ in scheduled]
        starts = np.fromiter((req.num_computed_tokens for req in reqs), np.int64, num_seqs)
        counts = np.fromiter((n for _, n in scheduled), np.int64, num_seqs)
        ends = np.cumsum(counts)
        num_tokens = int(ends[-1])
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        query_start_loc[1:] = ends
        seq_lens = (starts + counts).astype(np.int32)
        max_query_len, max_seq_len = int(counts.max()), int(seq_lens.max())
        row_of_token = np.repeat(np.arange(num_seqs), counts)
        positions = np.arange(num_tokens) + np.repeat(starts - (ends - counts), counts)
        block_tables = self.kv.block_tables(reqs)
        if num_tokens == num_seqs and not any(req.spec_token_ids for req in reqs) and (
                np.fromiter((len(req.all_token_ids) + req.num_in_flight for req in reqs),
                            np.int64, num_seqs) == seq_lens).all():
            # a decode: each row's last token (0 for now where in flight), each samples
            input_ids = [0 if req.num_in_flight else req.all_token_ids[-1] for req in reqs]
            logits_indices, sampling_requests = list(range(num_seqs)), reqs
            num_logits_rows, prompt_rows = [1] * num_seqs, []
        else:
            input_ids, logits_indices, sampling_requests, num_logits_rows, prompt_rows = \
                self._rows(scheduled, starts.tolist(), ends.tolist())
        input_ids = np.array(input_ids, dtype=np.int64)
        slot_mapping = block_tables[row_of_token, positions // bs].astype(np.int64) * bs \
            + positions % bs
        graphs = bucket = None
        if len(sampling_requests) == num_seqs and not prompt_rows:  # every row decodes
            graphs = self.graphs if num_tokens == num_seqs else self.spec_graphs
            if graphs is not None and max_query_len <= graphs.tokens_per_row:
                bucket = graphs.bucket(num_seqs)
        arrays = (input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables)
        indices = np.array(logits_indices, dtype=np.int64)
        pieces = None
        if bucket is not None:  # straight into the graphs' own inputs
            sent = graphs.stage(bucket, *graphs.pad(bucket, *arrays), indices)
        elif self.pieces is not None and self.pieces.bucket(num_tokens) is not None:
            graphs, pieces = None, self.pieces
            sent = pieces.stage(*arrays, indices)
        else:
            graphs, sent = None, self.staging.send(*arrays, indices)
        (input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
         logits_indices_t) = sent
        if in_flight is not None:
            self._tokens_in_flight(input_ids, reqs, ends, in_flight)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
            slot_mapping=slot_mapping, max_query_len=max_query_len, max_seq_len=max_seq_len)
        return ModelInput(input_ids=input_ids, positions=positions, meta=meta,
                          logits_indices=logits_indices_t, sampling_requests=sampling_requests,
                          num_logits_rows=num_logits_rows, graphs=graphs, graph_bucket=bucket,
                          pieces=pieces, prompt_logprob_rows=prompt_rows)

    def _tokens_in_flight(self, input_ids: torch.Tensor, reqs: list[Request],
                          ends: np.ndarray, in_flight: InFlightTokens) -> None:
        """Each in-flight token from the last step's samples into the step's input ids on
        the device, queued behind the sampler that drew it: one copy where the rows are the
        last step's in its order (a run of decode steps), else one scatter. A row with a
        token in flight is a running request's decode row, that token its last (the
        scheduler admits no request with one)."""
        rows = in_flight.rows_of(reqs)
        if rows is None:  # the last step's rows, each a decode row now
            input_ids[:len(reqs)].copy_(in_flight.token_ids)
            return
        flying = np.flatnonzero(rows >= 0)
        if len(flying):
            dst, src = self.scatter_staging.send(ends[flying] - 1, rows[flying])
            input_ids[dst] = in_flight.token_ids[src]

    @staticmethod
    def _rows(scheduled: list[tuple[Request, int]], starts: list[int], ends: list[int]):
        """A step with prefill chunks or drafts, row by row: its tokens, the rows that
        sample (and their requests and counts) and the rows that score prompt tokens."""
        input_ids: list[int] = []
        logits_indices, sampling_requests, prompt_rows, num_logits_rows = [], [], [], []
        for (req, n), start, end in zip(scheduled, starts, ends, strict=True):
            tokens = req.all_token_ids[start:start + n]
            if req.num_in_flight:  # its last, on the device (`_tokens_in_flight`)
                tokens = tokens + [0] * req.num_in_flight
            if len(tokens) < n:  # the drafts the step checks follow the last token
                tokens = tokens + req.spec_token_ids[:n - len(tokens)]
            input_ids += tokens
            if start + n == req.num_tokens_with_spec:
                k = len(req.spec_token_ids)
                logits_indices.extend(range(end - 1 - k, end))
                sampling_requests.append(req)
                num_logits_rows.append(1 + k)
            if req.options.prompt_logprobs is not None:
                # Position p's logits score the token at p + 1; entries already made (before
                # a preemption) are not made again.
                lo = max(start, len(req.prompt_logprob_entries) - 1)
                hi = min(start + n, req.num_prompt_tokens - 1)
                if lo < hi:
                    prompt_rows.append((req, end - n + lo - start, lo, hi))
        return input_ids, logits_indices, sampling_requests, num_logits_rows, prompt_rows

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor | None:
        """Logits [S', vocab] (the model's logits_dtype) for the rows that sample, or None."""
        if not self._threads_set:  # from the thread that steps: see CpuBackend.torch_threads
            if self.model.backend.torch_threads:
                torch.set_num_threads(self.model.backend.torch_threads)
            self._threads_set = True
        if inp.graphs is not None:  # a decode: every row samples, in order
            logits = inp.graphs.replay(inp.graph_bucket, inp.meta.max_seq_len)
            if inp.graphs.tokens_per_row == 1:
                return logits[:len(inp.sampling_requests)]
            return logits[inp.logits_indices]  # each row's tokens, drafts and all
        forward = self.model.forward if inp.pieces is None else inp.pieces.forward
        hidden = forward(inp.input_ids, inp.positions, inp.meta, self.kv_caches)
        for req, row, lo, hi in inp.prompt_logprob_rows:
            req.prompt_logprob_entries += self._prompt_logprobs(hidden[row:row + hi - lo],
                                                                req, lo, hi)
        if not inp.sampling_requests:
            return None
        return self.model.compute_logits(hidden[inp.logits_indices])

    def sample_in_graphs(self, inp: ModelInput, columns: SamplerColumns
                         ) -> SamplerOutput | None:
        """The step's samples from the decode graphs' sampler, after the forward it replayed,
        where one takes its rows' columns; None where not (the caller samples eagerly)."""
        graphs = inp.graphs
        if graphs is None or not graphs.with_sampler or not columns.fit_graphs(WINDOW):
            return None
        fill = None
        if columns.fills is not None:  # tokens in flight, into their windows on the device
            def fill(window: torch.Tensor) -> None:
                fill_in_flight(window, self.scatter_staging.send(*columns.fills),
                               columns.in_flight)
        out = graphs.sample_rows(inp.graph_bucket, inp.meta.max_seq_len, columns.columns[:9],
                                 columns.window, fill)
        n = len(inp.sampling_requests)
        return SamplerOutput(out.token_ids[:n], out.logprobs[:n], out.top_token_ids[:n],
                             out.top_logprobs[:n])

    def _prompt_logprobs(self, hidden: torch.Tensor, req: Request, lo: int, hi: int
                         ) -> list[TokenLogprob]:
        """Raw logprobs (and the top-N) of the prompt tokens at positions lo + 1 .. hi, from
        the hidden states at positions lo .. hi - 1, as the sampler computes a sampled token's:
        a host copy, for echo requests only."""
        entries = []
        targets = req.prompt_token_ids[lo + 1:hi + 1]
        for i in range(0, hi - lo, PROMPT_LOGPROB_ROWS):
            rows = slice(i, min(i + PROMPT_LOGPROB_ROWS, hi - lo))
            entries += raw_logprobs(self.model.compute_logits(hidden[rows]), targets[rows],
                                    req.options.prompt_logprobs, self.cpu_draw)
        return entries
