"""The runtime side of sampling: builds the batch's SamplingMetadata from its requests and
calls the fused Triton kernel (CUDA) or its torch reference (CPU).

Random streams: a seeded request draws from (seed, index of the token in its reply), so its
tokens depend neither on other requests nor on what ran before it. Unseeded requests share
one server generator that carries on; it hands each row a fresh stream every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kiln.kernels.sampling import sample
from kiln.kernels.sampling_metadata import SamplerOutput, SamplingMetadata
from kiln.kernels.sampling_ref import logprobs_from_stats, sample_ref
from kiln.runtime.backends.cpu import library
from kiln.runtime.backends.cpu.race import CpuDraw
from kiln.runtime.engine.request import InFlightTokens, Request, TokenLogprob
from kiln.runtime.engine.staging import StagingBuffer
from kiln.runtime.sampling.grammar import build_grammar_bitmask
from kiln.runtime.sampling.sampler_rows import SamplerRows

FEW_ROWS = 8  # below this, numpy's per-call cost exceeds a Python loop's per-row cost


class Sampler:
    def __init__(self, device: torch.device, use_triton: bool, seed: int | None = None):
        self.device, self.use_triton = device, use_triton
        self.server_rng = np.random.default_rng(seed)
        self.staging = StagingBuffer(device)
        self.rows = SamplerRows()
        # CUDA: where the samples come back to, two buffers used by turns
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self.cpu_draw = cpu_draw_for(device, use_triton)

    def columns(self, requests: list[Request], vocab_size: int,
                in_flight: InFlightTokens | None = None) -> SamplerColumns:
        """Every column built on the host; the batch flags come from the host-side settings,
        so nothing here waits for the device. The rows' settings and windows are carried
        from the last step (SamplerRows); what is worked out each step is the server's
        draws, seeded rows' offsets, biases and grammar masks. A penalty window whose newest
        token is still in flight takes it on the device, in the ring column the host puts it
        in once read (`send`). Built once a step: the server's stream moves on."""
        rows, n = self.rows, len(requests)
        rows.update(requests)
        fills = rows.in_flight_columns(in_flight.rows_of(requests)) \
            if in_flight is not None else None
        seeds, offsets = rows.seeds.copy(), np.zeros(n, dtype=np.int64)
        if rows.seeded_rows:
            offsets[rows.seeded_rows] = [len(requests[i].output_token_ids)
                                         + requests[i].num_in_flight
                                         for i in rows.seeded_rows]
        # The server's stream, a draw per row in row order: one call draws the same numbers
        # as a call per row, and past a few rows costs less.
        drawn = rows.drawn_rows
        if len(drawn) > FEW_ROWS:
            seeds[drawn] = self.server_rng.integers(0, 2**63 - 1, size=len(drawn))
        else:
            for i in drawn.tolist():
                seeds[i] = int(self.server_rng.integers(0, 2**63 - 1))
        # [7, n]: temperature, top_k, top_p, min_p, the penalties (top_k exact in fp32 up to
        # 2^24, past any vocabulary)
        values = rows.value_columns
        columns = [
            values[0],
            # top_k >= vocab keeps everything: clamp so any stored value fits in int32.
            np.minimum(values[1], vocab_size).astype(np.int32),
            *values[2:], seeds, offsets,
        ]
        optional = {}  # name -> index in columns
        if len(rows.window_rows) and rows.window.shape[1]:
            optional["window"] = len(columns)
            columns.append(rows.window)
        bias_rows, biases = [], []
        for i in rows.biased_rows:
            if bias := _row_bias(requests[i]):
                bias_rows.append(i)
                biases.append(bias)
        if biases and (bias_width := max(map(len, biases))):
            optional["bias"] = len(columns)
            columns += [_padded(n, bias_rows, biases, bias_width, np.int64, -1),
                        _padded(n, bias_rows, [b.values() for b in biases], bias_width,
                                np.float32, 0.0)]
        if rows.has_grammar:
            optional["bitmask"] = len(columns)
            columns.append(build_grammar_bitmask([r.grammar for r in requests],
                                                 vocab_size).numpy())
        if fills is not None and len(fills[0]):
            optional["fills"] = len(columns)
            columns += fills
        return SamplerColumns(columns, optional, rows.num_top, rows.batch_flags, in_flight)

    def send(self, cols: SamplerColumns) -> SamplingMetadata:
        """The columns on the device, in one copy."""
        sent, optional = self.staging.send(*cols.columns), cols.optional
        if "fills" in optional:
            fill_in_flight(sent[optional["window"]],
                           sent[optional["fills"]:optional["fills"] + 3], cols.in_flight)

        def get(name: str, offset: int = 0):
            return sent[optional[name] + offset] if name in optional else None

        return SamplingMetadata(
            *sent[:7], window_token_ids=get("window"), seeds=sent[7], offsets=sent[8],
            grammar_bitmask=get("bitmask"), num_top_logprobs=cols.num_top,
            flags=cols.flags, bias_token_ids=get("bias"), bias_values=get("bias", 1))

    def draft_logprobs(self, logits: torch.Tensor, rows: list[int], token_ids: list[int],
                       num_top: int) -> list[TokenLogprob]:
        """Raw logprobs of accepted drafts (a greedy reply's are the same bits with drafting
        or without)."""
        return raw_logprobs(logits[rows], token_ids, num_top, self.cpu_draw)

    def fetch(self, out: SamplerOutput) -> HostSamples:
        """The step's one device-to-host copy, waited for."""
        return self.wait(self.copy_out(out))

    def copy_out(self, out: SamplerOutput) -> CopyOut:
        """The step's one device-to-host copy, queued: token ids (exact in float64), their
        logprobs and the top-N, packed side by side; on CUDA into pinned memory, one of two
        by turns (--async-scheduling reads a step's copy after queueing the next one's)."""
        n = out.top_token_ids.shape[1]
        parts = [out.token_ids[:, None].double(), out.logprobs[:, None].double()]
        if n:
            parts += [out.top_token_ids.double(), out.top_logprobs.double()]
        packed = torch.cat(parts, dim=1)
        if not packed.is_cuda:
            return CopyOut(packed, n, None)
        self._turn ^= 1
        pinned = self._pinned[self._turn]
        if pinned is None or pinned.numel() < packed.numel():
            pinned = self._pinned[self._turn] = torch.empty(
                max(packed.numel(), 1 << 14), dtype=torch.float64, pin_memory=True)
        host = pinned[:packed.numel()].view(packed.shape)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return CopyOut(host, n, done)

    def wait(self, copy: CopyOut) -> HostSamples:
        """The samples of a queued copy, once it has landed (the host waits for the
        sampler's last kernel of that step, not for anything queued after it)."""
        if copy.done is not None:
            copy.done.synchronize()
        packed, n = copy.packed.numpy(), copy.num_top
        rows = len(packed)
        return HostSamples(
            packed[:, 0].astype(np.int64).tolist(), packed[:, 1].tolist(),
            packed[:, 2:2 + n].astype(np.int64).tolist() if n else [[]] * rows,
            packed[:, 2 + n:].tolist() if n else [[]] * rows)

    def run(self, logits: torch.Tensor, cols: SamplerColumns) -> SamplerOutput:
        """The fused sampler (or its reference) on columns built for these rows."""
        meta = self.send(cols)
        if self.use_triton:
            return sample(logits, meta)
        return sample_ref(logits, meta, cpu=self.cpu_draw)


def fill_in_flight(window: torch.Tensor, fills: list[torch.Tensor],
                   in_flight: InFlightTokens) -> None:
    """The windows' tokens still in flight into their ring columns, on the device, queued
    behind the sampler that drew them. fills: SamplerColumns.fills, sent."""
    rows, columns, src = fills
    window[rows, columns] = in_flight.token_ids[src]


def cpu_draw_for(device: torch.device, use_triton: bool) -> CpuDraw | None:
    """kiln's C kernels for the CPU sampler (sample_ref): each row's max and log-sum-exp, and
    without top_k its draw, where they run; None elsewhere."""
    if use_triton or torch.device(device).type != "cpu" or library.unavailable_reason():
        return None
    return CpuDraw()


def raw_logprobs(logits: torch.Tensor,  # [N, V]: a row per token
                 token_ids: list[int], num_top: int, cpu_draw: CpuDraw | None
                 ) -> list[TokenLogprob]:
    """Raw logprobs of the tokens and each row's top num_top, computed as the CPU sampler
    computes a sampled token's: a token scored in an echoed prompt, kept from a draft or
    sampled gets the same bits from the same logits."""
    raw = logits.float()
    ids = torch.tensor(token_ids, device=logits.device)
    if cpu_draw is None:
        logprobs_all = torch.log_softmax(raw, dim=-1)
        chosen = logprobs_all.gather(1, ids[:, None])[:, 0]
        top_values, top_ids = torch.topk(logprobs_all, num_top, dim=-1)
    else:
        m, _, log_sum = cpu_draw.row_stats(raw)
        chosen, top_ids, top_values = logprobs_from_stats(raw, m, log_sum, ids, num_top)
    return [TokenLogprob(t, lp, list(zip(i, v))) for t, lp, i, v in
            zip(token_ids, chosen.tolist(), top_ids.tolist(), top_values.tolist())]


def _padded(n: int, rows: list[int], values: list, width: int, dtype, fill) -> np.ndarray:
    """[n, width]: row rows[i] holds values[i] (each iterable, at most width long) from its
    start, the rest `fill`. A few rows are copied one by one; more in one assignment of all
    their values (row-major, as the mask's True cells), a few numpy calls whatever n."""
    out = np.full((n, width), fill, dtype=dtype)
    if len(rows) <= FEW_ROWS:
        for i, v in zip(rows, values):
            out[i, :len(v)] = list(v)
        return out
    lengths = np.fromiter(map(len, values), np.int64, len(values))
    cells = np.zeros((n, width), dtype=bool)
    cells[rows] = np.arange(width) < lengths[:, None]
    out[cells] = np.fromiter(chain.from_iterable(values), dtype, int(lengths.sum()))
    return out


def _row_bias(req: Request) -> dict[int, float] | None:
    """The request's logit_bias, and -inf on its stop tokens while min_tokens is not reached
    (not under a grammar: the grammar alone decides where structured output ends); None
    where that is nothing (most rows: no dict built for them)."""
    banned = req.stop_token_ids if req.grammar is None \
        and len(req.output_token_ids) + req.num_in_flight < req.options.min_tokens else ()
    if not (req.options.logit_bias or banned):
        return None
    bias = dict(req.options.logit_bias)
    for token in banned:
        bias[token] = float("-inf")
    return bias


@dataclass
class SamplerColumns:
    """A step's sampling columns on the host, in SamplingMetadata's order: temperature, top_k,
    top_p, min_p, the three penalties, seeds, offsets; then the optional ones."""

    columns: list[np.ndarray]
    optional: dict[str, int]  # "window", "bias" (ids, values), "bitmask", "fills" -> index
    num_top: int
    flags: tuple[bool, bool, bool, bool]
    in_flight: InFlightTokens | None  # where the fills' tokens are

    @property
    def window(self) -> np.ndarray | None:
        """[n, W] the penalty windows' rings, -1 padded; None: no row has penalties."""
        return self.columns[self.optional["window"]] if "window" in self.optional else None

    @property
    def fills(self) -> list[np.ndarray] | None:
        """(rows, ring columns, rows in the last step) of the windows' tokens in flight."""
        i = self.optional.get("fills")
        return None if i is None else self.columns[i:i + 3]

    def fit_graphs(self, window_width: int) -> bool:
        """What the decode graphs' sampler takes: the nine per-row values and a penalty
        window no wider than window_width; no logit_bias, grammar or top logprobs."""
        return self.num_top == 0 and set(self.optional) <= {"window", "fills"} and (
            self.window is None or self.window.shape[1] <= window_width)


@dataclass
class CopyOut:
    """A step's samples on their way to the host."""

    packed: torch.Tensor  # [rows, 2 + 2 * num_top] float64, host memory
    num_top: int
    done: torch.cuda.Event | None  # CUDA: recorded after the copy


@dataclass
class HostSamples:
    """A step's sampled tokens on the host, with the logprobs the kernel computed (the
    top-N lists empty where no row asked for them)."""

    token_ids: list[int]
    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


def raw_choices(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> list[int]:
    """What drafts are checked against: the model's own choice at each given row of `logits`
    (requests[i] is row i's), the argmax of its raw logits with the request's logit_bias
    added (a bias is a constraint, not a sampling setting), the first on ties as the
    sampler's greedy choice."""
    x = logits[rows].float()
    for i, req in enumerate(requests):
        if req.options.logit_bias:
            ids, values = zip(*req.options.logit_bias)
            x[i, list(ids)] += torch.tensor(values, dtype=x.dtype, device=x.device)
    return x.max(-1).indices.tolist()




def to_token_logprobs(out: HostSamples, requests: list[Request]) -> list[TokenLogprob | None]:
    """Per row, the chosen token's raw logprob and its top-N, for rows that asked."""
    return [None if (n := r.options.logprobs) is None else TokenLogprob(
        out.token_ids[i], out.logprobs[i],
        list(zip(out.top_token_ids[i][:n], out.top_logprobs[i][:n])))
        for i, r in enumerate(requests)]
