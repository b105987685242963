"""Fused token sampling: penalties (and logit_bias) -> grammar mask -> top_k -> top_p / min_p
-> temperature -> draw.

One launch, one program per row, no sort. Passes over the row, BLOCK_V tokens at a time:
raw log-sum-exp (+ the processed max); the penalty fix-up on the window's tokens, then the
row's logit_bias added on its tokens (a bias of -inf bans a token: min_tokens); top-N raw
logprobs (one argmax pass each); the top_k then top_p thresholds, each a pivot search over an
order-preserving int32 key of the fp32 logits (a pass counts and weighs the tokens above
NUM_PIVOTS pivots and shrinks the bracket (NUM_PIVOTS + 1)x: with 8, exact after at most 11
passes, any vocab);
the draw. Ties: every token equal to the threshold is kept (top_k may keep more than k,
top_p keeps the crossing token and its equals); argmax ties go to the lowest token id.

The draw is the exponential race: token = argmax_j p_j / E_j, E_j = -log U_j, where U_j is
Philox4x32-10 (`tl.rand`) with key `seed` and counter (token j, step): a row's token depends
only on its own logits, seed and step. Greedy rows (temperature 0 or top_k 1) take the argmax
of the penalised, masked logits and draw nothing. `sample_ref` is the same pipeline in torch
(also the CPU sampler): the same Philox bit for bit, evaluated on surviving tokens only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels import INTERPRET
from kiln.kernels.sampling_metadata import SamplerOutput, SamplingMetadata, check_inputs

BLOCK_W = 128  # window (or bias) tokens per step of the fix-up loops (not from their length)
# Launch defaults, measured on an H200 (bench/gpu_check.py --sampler-sweep, 2026-12-04, at
# served shapes: 1 to 256 rows, vocab 49,152 and 151,936, the default model's settings): a
# first sweep (blocks 1024/2048/4096 x 4/8/16 warps x 8/16/32 pivots) put 2048 x 8 warps x
# 8 pivots first everywhere, 1.36-1.40x the former 1024 x 8 x 16; a second, around it, found
# 16 warps 1.05-1.12x faster again at every shape (4096 x 16 is faster still at 1-16 rows,
# slower at 256).
BLOCK_V = 2048
NUM_PIVOTS = 8
NUM_WARPS = 16
KEY_NEG_INF = tl.constexpr(-(2**31) + 0x7FFFFF)  # _ordered_key(-inf)


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 with the same order (-0.0 folded into +0.0), so thresholds are exact."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _uniform(seed, step, token_ids):
    """U[0, 1) for (seed, step, token): Philox counter (token, step, 0, 0), key seed."""
    return tl.rand(seed, (step << 32) | token_ids.to(tl.int64))


@triton.jit
def _allowed(bitmask_row_ptr, offs, in_vocab):
    """xgrammar layout: bit j of word w allows token 32 * w + j."""
    words = tl.load(bitmask_row_ptr + (offs >> 5), mask=in_vocab, other=0)
    return ((words >> (offs & 31)) & 1) != 0


@triton.jit
def _load_processed(logits_row_ptr, work_row_ptr, bitmask_row_ptr, offs, vocab_size,
                    HAS_PENALTIES: tl.constexpr, HAS_GRAMMAR: tl.constexpr):
    """Logits after penalties and grammar mask; -inf for masked tokens and padding lanes."""
    in_vocab = offs < vocab_size
    if HAS_PENALTIES:  # written once by pass 0 and the window fix-up
        x = tl.load(work_row_ptr + offs, mask=in_vocab, other=float("-inf"))
    else:
        x = tl.load(logits_row_ptr + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        if HAS_GRAMMAR:
            x = tl.where(_allowed(bitmask_row_ptr, offs, in_vocab), x, float("-inf"))
    return x


@triton.jit
def _online_max_sum(x, m, s):
    """Fold a block into a running max m and sum(exp(. - m)) s; safe while all are -inf."""
    new_m = tl.maximum(m, tl.max(x))
    safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
    return new_m, s * tl.exp(m - safe_m) + tl.sum(tl.exp(x - safe_m))


@triton.jit
def _processed_stats(x, start, best, best_idx, z, n_finite):
    """Max, first argmax, mass sum(exp(x - max)) and finite count of the processed logits."""
    best_idx = tl.where(tl.max(x) > best, start + tl.argmax(x, 0), best_idx)
    best, z = _online_max_sum(x, best, z)
    return best, best_idx, z, n_finite + tl.sum((x > float("-inf")).to(tl.int32))


@triton.jit
def _pivot_search(logits_row_ptr, work_row_ptr, bitmask_row_ptr, vocab_size,
                  lo, hi, lo_mass, k, target_mass, m, need_mass,
                  BY_COUNT: tl.constexpr,
                  HAS_PENALTIES: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
                  BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """Largest key t in [lo, hi) with count(key >= t) >= k (BY_COUNT) or mass >= target_mass.

    Invariant: lo qualifies, hi does not; mass = sum exp(x - m). Also returns mass(key >= t).
    """
    steps = tl.arange(0, NUM_PIVOTS).to(tl.int64) + 1
    while hi - lo > 1:
        pivots = lo + ((hi - lo) * steps) // (NUM_PIVOTS + 1)  # [P] increasing, in (lo, hi)
        pivots_i32 = pivots.to(tl.int32)  # keys span int32; only the midpoint math needs int64
        counts = tl.zeros([NUM_PIVOTS], dtype=tl.int32)
        masses = tl.zeros([NUM_PIVOTS], dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = _load_processed(logits_row_ptr, work_row_ptr, bitmask_row_ptr, offs, vocab_size,
                                HAS_PENALTIES, HAS_GRAMMAR)  # x: [BLOCK_V]
            above = _ordered_key(x)[:, None] >= pivots_i32[None, :]  # above: [BLOCK_V, P]
            counts += tl.sum(above.to(tl.int32), axis=0)
            if need_mass:
                masses += tl.sum(tl.where(above, tl.exp(x - m)[:, None], 0.0), axis=0)
        ok = (counts >= k) if BY_COUNT else (masses >= target_mass)
        new_lo = tl.max(tl.where(ok, pivots, lo))
        lo_mass = tl.min(tl.where(ok, masses, lo_mass))
        hi = tl.min(tl.where(ok, hi, pivots))
        lo = new_lo
    return lo, lo_mass


# Batch-dependent values are not specialised on, so the variants warmed at load are all a
# model's steps launch (kernels/warmup.py).
@triton.jit(do_not_specialize=["logits_row_stride", "window_row_stride", "window_len",
                               "bias_row_stride", "bias_len", "bitmask_row_stride", "num_top"])
def _sample_kernel(
    logits_ptr,          # [B, V] fp32 / bf16 / fp16
    logits_row_stride,
    work_ptr,            # [B, V] fp32 scratch: processed logits (HAS_PENALTIES)
    counts_ptr,          # [B, V] int32 scratch: window counts, touched at window tokens only
    processed_ptr,       # [B, V] fp32 debug output: the logits the draw saw (WRITE_PROCESSED)
    temperature_ptr,     # [B] fp32
    top_k_ptr,           # [B] int32
    top_p_ptr,           # [B] fp32
    min_p_ptr,           # [B] fp32
    rep_penalty_ptr,     # [B] fp32
    freq_penalty_ptr,    # [B] fp32
    pres_penalty_ptr,    # [B] fp32
    window_ptr,          # [B, W] int64, -1 padded
    window_row_stride,
    window_len,
    bias_ids_ptr,        # [B, L] int64 logit_bias token ids, -1 padded, unique in a row
    bias_values_ptr,     # [B, L] fp32 (-inf bans)
    bias_row_stride,
    bias_len,
    bitmask_ptr,         # [B, ceil(V / 32)] int32
    bitmask_row_stride,
    seeds_ptr,           # [B] int64
    offsets_ptr,         # [B] int64
    token_ids_ptr,       # [B] int64 out
    logprobs_ptr,        # [B] fp32 out
    top_ids_ptr,         # [B, NUM_TOP] int64 out
    top_logprobs_ptr,    # [B, NUM_TOP] fp32 out
    vocab_size,
    num_top,             # NUM_TOP, 0..20
    # Only what changes the row's memory traffic is a constexpr; top_k, top_p, min_p and
    # greedy are per-row branches, so a model needs 4 compiled variants (warmed at load).
    HAS_PENALTIES: tl.constexpr, HAS_GRAMMAR: tl.constexpr, WRITE_PROCESSED: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row_ptr = logits_ptr + row * logits_row_stride
    work_row_ptr = work_ptr + row * vocab_size
    counts_row_ptr = counts_ptr + row * vocab_size
    bitmask_row_ptr = bitmask_ptr + row * bitmask_row_stride
    NEG_INF: tl.constexpr = float("-inf")

    # Pass 0: raw log-sum-exp for logprobs; processed max / argmax / mass (no penalties).
    raw_m = tl.full([], NEG_INF, tl.float32)
    raw_s = tl.zeros([], dtype=tl.float32)
    best = tl.full([], NEG_INF, tl.float32)
    best_idx = tl.zeros([], dtype=tl.int32)
    n_finite = tl.zeros([], dtype=tl.int32)
    z = tl.zeros([], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab_size
        x = tl.load(logits_row_ptr + offs, mask=in_vocab, other=NEG_INF).to(tl.float32)
        raw_m, raw_s = _online_max_sum(x, raw_m, raw_s)
        if HAS_GRAMMAR:
            x = tl.where(_allowed(bitmask_row_ptr, offs, in_vocab), x, NEG_INF)
        if HAS_PENALTIES:
            tl.store(work_row_ptr + offs, x, mask=in_vocab)
        else:
            best, best_idx, z, n_finite = _processed_stats(x, start, best, best_idx, z, n_finite)
    lse = raw_m + tl.log(raw_s)

    if HAS_PENALTIES:
        # Window fix-up: zero the counters of window tokens, count with atomics, then every
        # occurrence writes the same penalised value (idempotent, so duplicates do not race).
        rep = tl.load(rep_penalty_ptr + row)
        freq = tl.load(freq_penalty_ptr + row)
        pres = tl.load(pres_penalty_ptr + row)
        for phase in tl.static_range(3):
            tl.debug_barrier()
            for w0 in range(0, window_len, BLOCK_W):
                w_offs = w0 + tl.arange(0, BLOCK_W)
                tok = tl.load(window_ptr + row * window_row_stride + w_offs,
                              mask=w_offs < window_len, other=-1)  # tok: [BLOCK_W]
                valid = (tok >= 0) & (tok < vocab_size)
                if phase == 0:
                    tl.store(counts_row_ptr + tok, tl.zeros_like(tok).to(tl.int32), mask=valid)
                elif phase == 1:
                    tl.atomic_add(counts_row_ptr + tok, tl.full(tok.shape, 1, tl.int32),
                                  mask=valid)
                else:
                    c = tl.load(counts_row_ptr + tok, mask=valid, other=0, volatile=True)
                    v = tl.load(logits_row_ptr + tok, mask=valid, other=0.0).to(tl.float32)
                    v = tl.where(v <= 0.0, v * rep, tl.math.div_rn(v, rep))
                    v = v - (c.to(tl.float32) * freq + pres)
                    if HAS_GRAMMAR:
                        v = tl.where(_allowed(bitmask_row_ptr, tok, valid), v, NEG_INF)
                    tl.store(work_row_ptr + tok, v, mask=valid)
        tl.debug_barrier()
        # logit_bias on the penalised values (ids unique in a row: no two lanes share one).
        for b0 in range(0, bias_len, BLOCK_W):
            b_offs = b0 + tl.arange(0, BLOCK_W)
            in_row = b_offs < bias_len
            tok = tl.load(bias_ids_ptr + row * bias_row_stride + b_offs, mask=in_row,
                          other=-1)  # tok: [BLOCK_W]
            valid = (tok >= 0) & (tok < vocab_size)
            bias = tl.load(bias_values_ptr + row * bias_row_stride + b_offs, mask=valid,
                           other=0.0)
            v = tl.load(work_row_ptr + tok, mask=valid, other=0.0, volatile=True)
            tl.store(work_row_ptr + tok, v + bias, mask=valid)
        tl.debug_barrier()
        # Pass 1: processed max / argmax / mass over the penalised logits.
        for start in range(0, vocab_size, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(work_row_ptr + offs, mask=offs < vocab_size, other=NEG_INF)
            best, best_idx, z, n_finite = _processed_stats(x, start, best, best_idx, z, n_finite)

    # Top-N raw logprobs: N passes of argmax over the tokens ordered after the previous pick
    # (descending value, ascending index).
    top_ids_row_ptr = top_ids_ptr + row * num_top
    top_lp_row_ptr = top_logprobs_ptr + row * num_top
    prev_val = tl.full([], float("inf"), tl.float32)
    prev_idx = tl.full([], -1, tl.int32)
    for n in range(num_top):
        n_val = tl.full([], NEG_INF, tl.float32)
        n_idx = tl.zeros([], dtype=tl.int32)
        for start in range(0, vocab_size, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            raw = tl.load(logits_row_ptr + offs, mask=offs < vocab_size, other=NEG_INF)
            after = (raw < prev_val) | ((raw == prev_val) & (offs > prev_idx))
            raw = tl.where(after, raw.to(tl.float32), NEG_INF)
            blk_best = tl.max(raw)
            n_idx = tl.where(blk_best > n_val, start + tl.argmax(raw, 0), n_idx)
            n_val = tl.maximum(n_val, blk_best)
        tl.store(top_ids_row_ptr + n, n_idx.to(tl.int64))
        tl.store(top_lp_row_ptr + n, n_val - lse)
        prev_val, prev_idx = n_val, n_idx

    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    token = best_idx
    if (temperature == 0.0) | (top_k == 1):
        if WRITE_PROCESSED:  # greedy rows: penalties + mask only
            for start in range(0, vocab_size, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                x = _load_processed(logits_row_ptr, work_row_ptr, bitmask_row_ptr, offs,
                                    vocab_size, HAS_PENALTIES, HAS_GRAMMAR)
                tl.store(processed_ptr + row * vocab_size + offs, x, mask=offs < vocab_size)
    else:
        m = tl.where(best == NEG_INF, 0.0, best)
        hi0 = _ordered_key(best).to(tl.int64) + 1
        thr = tl.full([], KEY_NEG_INF, tl.int64)  # keep every finite token
        # An inactive filter gets an empty bracket (hi = lo + 1): its search runs no pass.
        top_p = tl.load(top_p_ptr + row)
        hi = tl.where((top_k > 0) & (top_k < n_finite), hi0, thr + 1)
        thr, z = _pivot_search(logits_row_ptr, work_row_ptr, bitmask_row_ptr, vocab_size,
                               thr, hi, z, top_k, 0.0, m, top_p < 1.0, True,
                               HAS_PENALTIES, HAS_GRAMMAR, BLOCK_V, NUM_PIVOTS)
        hi = tl.where(top_p < 1.0, hi0, thr + 1)
        thr, z = _pivot_search(logits_row_ptr, work_row_ptr, bitmask_row_ptr, vocab_size,
                               thr, hi, z, 0, top_p * z, m, True, False,
                               HAS_PENALTIES, HAS_GRAMMAR, BLOCK_V, NUM_PIVOTS)
        min_p = tl.load(min_p_ptr + row)
        seed, step = tl.load(seeds_ptr + row), tl.load(offsets_ptr + row)
        # Final pass: survivors race with score p_j / E_j (p unnormalised: argmax ignores Z).
        score_best = tl.full([], NEG_INF, tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = _load_processed(logits_row_ptr, work_row_ptr, bitmask_row_ptr, offs,
                                vocab_size, HAS_PENALTIES, HAS_GRAMMAR)  # x: [BLOCK_V]
            keep = (x > NEG_INF) & (_ordered_key(x) >= thr.to(tl.int32))
            keep = keep & (tl.exp(x - m) >= min_p)  # p / p_max; always true at min_p 0
            e = -tl.log(_uniform(seed, step, offs))  # E: [BLOCK_V]
            score = tl.where(keep, tl.exp(tl.math.div_rn(x - m, temperature)) / e, -1.0)
            blk_best = tl.max(score)
            token = tl.where(blk_best > score_best, start + tl.argmax(score, 0), token)
            score_best = tl.maximum(score_best, blk_best)
            if WRITE_PROCESSED:
                tl.store(processed_ptr + row * vocab_size + offs,
                         tl.where(keep, tl.math.div_rn(x, temperature), NEG_INF),
                         mask=offs < vocab_size)

    tl.store(token_ids_ptr + row, token.to(tl.int64))
    raw_tok = tl.load(logits_row_ptr + token).to(tl.float32)
    tl.store(logprobs_ptr + row, raw_tok - lse)


def sample(logits: torch.Tensor, metadata: SamplingMetadata, return_processed: bool = False,
           block_v: int | None = None, num_pivots: int = NUM_PIVOTS, num_warps: int = NUM_WARPS
           ) -> SamplerOutput:
    """Fused sampler: one launch, one program per row. See the module docstring."""
    check_inputs(logits, metadata)
    md = metadata
    B, V = logits.shape
    N = md.num_top_logprobs
    dev = logits.device
    if block_v is None:
        # The interpreter runs a block as numpy arrays: the bigger the fewer Python steps.
        block_v = min(triton.next_power_of_2(V), 8192) if INTERPRET else BLOCK_V
    token_ids, top_ids = (torch.empty(B, *n, dtype=torch.int64, device=dev) for n in ((), (N,)))
    logprobs, top_lps = (torch.empty(B, *n, dtype=torch.float32, device=dev) for n in ((), (N,)))
    processed = torch.empty(B, V, dtype=torch.float32, device=dev) if return_processed else None
    work, counts = logits, logits  # unused placeholders without penalties
    if md.has_penalties:
        work = torch.empty(B, V, dtype=torch.float32, device=dev)
        counts = torch.empty(B, V, dtype=torch.int32, device=dev)
    has_window, has_bias = md.window_token_ids is not None, md.bias_token_ids is not None
    window = md.window_token_ids if has_window else md.seeds.view(B, 1)
    bias_ids = md.bias_token_ids if has_bias else md.seeds.view(B, 1)
    bias_values = md.bias_values if has_bias else md.temperature.view(B, 1)
    bitmask = md.grammar_bitmask if md.has_grammar else md.top_k.view(B, 1)
    W = window.shape[1] if has_window else 0
    L = bias_ids.shape[1] if has_bias else 0
    _sample_kernel[(B,)](
        logits, logits.stride(0), work, counts, processed if return_processed else logits,
        md.temperature, md.top_k, md.top_p, md.min_p,
        md.repetition_penalty, md.frequency_penalty, md.presence_penalty,
        window, window.stride(0), W, bias_ids, bias_values, bias_ids.stride(0), L,
        bitmask, bitmask.stride(0),
        md.seeds, md.offsets, token_ids, logprobs, top_ids, top_lps, V, N,
        HAS_PENALTIES=md.has_penalties, HAS_GRAMMAR=md.has_grammar,
        WRITE_PROCESSED=return_processed, BLOCK_V=block_v, BLOCK_W=BLOCK_W,
        NUM_PIVOTS=num_pivots, num_warps=num_warps,
    )
    return SamplerOutput(token_ids, logprobs, top_ids, top_lps, processed)
