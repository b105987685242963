"""The fused sampler's torch reference, beside its kernel (kernels/sampling.py), and also the
CPU sampler: the same semantics and the same random stream, with the dense [B, V] work kept
to a few passes and Philox run on surviving tokens only."""

from __future__ import annotations

import torch

from kiln.kernels.sampling_metadata import SamplerOutput, SamplingMetadata, check_inputs

_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF
_PHILOX_CHUNK = 8192  # int64 temporaries stay in cache (and out of mmap'd allocations)


def philox_uniform_ref(seeds: torch.Tensor, offsets: torch.Tensor,
                       token_ids: torch.Tensor) -> torch.Tensor:
    """`_uniform` in torch, bit for bit: Philox4x32-10 word 0 mapped to [0, 1) as tl.rand does.

    1-D int64 arguments of one length. uint32 lanes live in int64 lanes; a 32x32-bit product
    wraps modulo 2**64 (two's complement), which leaves both 32-bit halves exact; the low half
    is masked lazily, after the xor that consumes it.
    """
    out = torch.empty(token_ids.shape, dtype=torch.float32, device=token_ids.device)
    for i in range(0, token_ids.numel(), _PHILOX_CHUNK):
        chunk = slice(i, i + _PHILOX_CHUNK)
        c0, c1 = token_ids[chunk] & _MASK32, offsets[chunk] & _MASK32
        c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
        k0, k1 = seeds[chunk] & _MASK32, (seeds[chunk] >> 32) & _MASK32
        for _ in range(10):
            prod_b, prod_a = c2 * _PHILOX_ROUND_B, c0 * _PHILOX_ROUND_A
            c0 = (prod_b >> 32).bitwise_xor_(c1).bitwise_xor_(k0).bitwise_and_(_MASK32)
            c2 = (prod_a >> 32).bitwise_xor_(c3).bitwise_xor_(k1).bitwise_and_(_MASK32)
            c1, c3 = prod_b, prod_a
            k0 = (k0 + _PHILOX_KEY_A).bitwise_and_(_MASK32)
            k1 = (k1 + _PHILOX_KEY_B).bitwise_and_(_MASK32)
        x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # the int32 bit pattern
        x = torch.where(x < 0, -x - 1, x)             # ~x
        out[chunk] = x.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V / 32)] int32 xgrammar words -> [B, V] bool allowed (little-endian bytes)."""
    bits = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    table = ((torch.arange(256, device=bitmask.device)[:, None] >> bits) & 1).bool()  # [256, 8]
    return table[bitmask.view(torch.uint8).long()].flatten(1)[:, :vocab_size]


def apply_penalties_ref_(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place: the contract's formula for every token with count c > 0 in the row's window."""
    B, V = x.shape
    win = md.window_token_ids
    rows, cols = ((win >= 0) & (win < V)).nonzero(as_tuple=True)
    flat = rows * V + win[rows, cols]
    _, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
    v, c = x.view(-1)[flat], counts[inverse].float()
    rep = md.repetition_penalty[rows]
    v = torch.where(v <= 0, v * rep, v / rep)
    v = v - (c * md.frequency_penalty[rows] + md.presence_penalty[rows])
    x.view(-1)[flat] = v  # repeated tokens write the same value
    return x


def apply_logit_bias_ref_(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place: each row's bias added on its tokens (ids unique within a row)."""
    ids = md.bias_token_ids
    rows, cols = ((ids >= 0) & (ids < x.shape[1])).nonzero(as_tuple=True)
    x[rows, ids[rows, cols]] += md.bias_values[rows, cols]
    return x


def _candidates_ref(x: torch.Tensor, m: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    md: SamplingMetadata):
    """Per-row value threshold after top_k then top_p (-inf: keep every finite token; ties
    at the threshold are kept), and the sorted candidates (values, ids) if they hold every
    survivor. torch.topk, grown 8x at a time for top_p-only rows; never a sort under top_k.
    """
    R, V = x.shape
    neg_inf = torch.full((R,), float("-inf"), device=x.device)
    k_on = (top_k > 0) & (top_k < V) & md.has_top_k
    p_on = (top_p < 1) & md.has_top_p
    if not bool((k_on | p_on).any()):
        return neg_inf, None
    z_all = torch.exp(x - m[:, None]).sum(-1) if bool((p_on & ~k_on).any()) else None
    n = min(V, max(int(top_k[k_on].max()) + 1 if bool(k_on.any()) else 0,
                   1024 if z_all is not None else 0))
    while True:
        vals, ids = torch.topk(x, n, dim=-1)  # [R, n], descending
        thr = torch.where(k_on, vals.gather(1, (top_k.long().clamp(1, n) - 1)[:, None])[:, 0],
                          neg_inf)
        in_k = (vals >= thr[:, None]) & (vals > float("-inf"))
        n_in = in_k.sum(-1)
        e = torch.where(in_k, torch.exp(vals - m[:, None]), 0.0)
        z = e.sum(-1)
        # The last candidate ties with the k-th value: tokens past the edge may tie too.
        edge = k_on & p_on & (vals[:, -1] >= thr) & (vals[:, -1] > float("-inf")) & (n < V)
        if bool(edge.any()):
            n_extra = ((x >= thr[:, None]) & (x > float("-inf"))).sum(-1) - n_in
            z = z + torch.where(edge, n_extra * torch.exp(thr - m), 0.0)
        if z_all is not None:
            z = torch.where(k_on, z, z_all)
        # The first candidate whose running mass reaches top_p * z is the last one kept.
        idx = (e.cumsum(-1) < (top_p * z)[:, None]).sum(-1)
        thr_p = vals.gather(1, torch.minimum(idx, (n_in - 1).clamp(min=0))[:, None])[:, 0]
        settled = k_on | ~p_on | ((idx < n_in) & (thr_p > vals[:, -1]))
        if n == V or bool(settled.all()):
            break
        n = min(V, 8 * n)
    thr = torch.where(p_on, torch.maximum(thr, thr_p), thr)
    complete = (thr > vals[:, -1]) | (vals[:, -1] == float("-inf")) | (n == V)
    return thr, (vals, ids) if bool(complete.all()) else None


def logprobs_from_stats(raw: torch.Tensor, m: torch.Tensor, log_sum: torch.Tensor,
                        token_ids: torch.Tensor, num_top: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen tokens' raw logprobs [B], the top-N ids [B, N] and logprobs [B, N] from
    each row's max and log-sum-exp (the CPU sampler's C kernels): (x - max) - log_sum."""
    logprobs = (raw.gather(1, token_ids[:, None])[:, 0] - m) - log_sum
    top_raw, top_ids = torch.topk(raw, num_top, dim=-1)
    return logprobs, top_ids, (top_raw - m[:, None]) - log_sum[:, None]


def sample_ref(logits: torch.Tensor, metadata: SamplingMetadata,
               return_processed: bool = False, cpu=None) -> SamplerOutput:
    """Torch twin of `sample`: same filters, same thresholds, same Philox stream and race.
    cpu: the CPU sampler's C kernels (runtime/backends/cpu/race.py's CpuDraw): the rows'
    max and log-sum-exp, and for batches without top_k top_p's threshold and the race over
    whole rows."""
    check_inputs(logits, metadata)
    md = metadata
    B, V = logits.shape
    raw = logits.float()
    if cpu is None:
        logprobs_all = torch.log_softmax(raw, dim=-1)
    else:  # the stats log_softmax needs, without its [B, V] output
        m_raw, argmax_raw, log_sum = cpu.row_stats(raw)
    x = raw
    if md.has_penalties or md.has_grammar:
        x = raw.clone() if raw.data_ptr() == logits.data_ptr() else raw  # x is ours to edit
        if md.window_token_ids is not None:
            apply_penalties_ref_(x, md)
        if md.bias_token_ids is not None:
            apply_logit_bias_ref_(x, md)
        if md.has_grammar:
            x.masked_fill_(~unpack_bitmask(md.grammar_bitmask, V), float("-inf"))
    m, token_ids = (m_raw, argmax_raw) if cpu is not None and x is raw else x.max(-1)
    processed = x.clone() if return_processed else None
    if not md.all_greedy:
        rows = ((md.temperature > 0) & (md.top_k != 1)).nonzero()[:, 0]
        xs, ms = (x, m) if rows.numel() == B else (x[rows], m[rows])  # [R, V], [R]
        ms = torch.where(ms == float("-inf"), 0.0, ms)
        top_k = md.top_k[rows]
        if cpu is not None and not return_processed \
                and not (md.has_top_k and bool(((top_k > 0) & (top_k < V)).any())):
            top_p = md.top_p[rows] if md.has_top_p else torch.ones_like(ms)
            thr = cpu.top_p_threshold(xs, ms, top_p)
            token_ids[rows] = cpu.race(xs, ms, thr, md.temperature[rows],
                                       md.min_p[rows] if md.has_min_p else None,
                                       md.seeds[rows], md.offsets[rows])
        else:
            thr, cand = _candidates_ref(xs, ms, top_k, md.top_p[rows], md)
            if cand is not None:  # survivors are a prefix-with-ties of the sorted candidates
                vals, ids = cand
                r, j = ((vals >= thr[:, None]) & (vals > float("-inf"))).nonzero(as_tuple=True)
                c, xv = ids[r, j], vals[r, j]
            else:
                r, c = ((xs >= thr[:, None]) & (xs > float("-inf"))).nonzero(as_tuple=True)
                xv = xs[r, c]
            if md.has_min_p:  # p / p_max = exp(x - m)
                kept = torch.exp(xv - ms[r]) >= md.min_p[rows][r]
                r, c, xv = r[kept], c[kept], xv[kept]
            # Exponential race: argmax p_j / E_j, ties to the lowest token id, as in the kernel.
            row_ids = rows[r]
            temp = md.temperature[row_ids]
            e = -torch.log(philox_uniform_ref(md.seeds[row_ids], md.offsets[row_ids], c))
            score = torch.exp((xv - ms[r]) / temp) / e
            R = rows.numel()
            best = torch.full((R,), -1.0, device=x.device).scatter_reduce(0, r, score, "amax")
            first = torch.where(score == best[r], c, V)
            tok = torch.full((R,), V, device=x.device).scatter_reduce(0, r, first, "amin")
            token_ids[rows] = torch.where(tok == V, 0, tok)  # no survivor: token 0, as the kernel
            if return_processed:
                proc = torch.full((R, V), float("-inf"), device=x.device)
                proc[r, c] = xv / temp
                processed[rows] = proc
    if cpu is None:
        logprobs = logprobs_all.gather(1, token_ids[:, None])[:, 0]
        top_logprobs, top_ids = torch.topk(logprobs_all, md.num_top_logprobs, dim=-1)
    else:
        logprobs, top_ids, top_logprobs = logprobs_from_stats(
            raw, m_raw, log_sum, token_ids, md.num_top_logprobs)
    return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs, processed)
