"""The sampler's per-tile kernels (grid: row x vocabulary tile) and the helpers every stage of
the sampler shares. kernels/sampling.py says how the stages fit together."""

from __future__ import annotations

import triton
import triton.language as tl

KEY_NEG_INF = tl.constexpr(-(2**31) + 0x7FFFFF)  # _ordered_key(-inf)
KEY_NONE = tl.constexpr(-(2**31))                 # below every token's key: "no key"


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 with the same order (-0.0 folded into +0.0), so thresholds are exact."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(key):
    """The fp32 value of an ordered key (the inverse of _ordered_key; KEY_NONE gives NaN)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


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
    """Logits after penalties, bias and grammar mask; -inf for masked tokens and padding."""
    in_vocab = offs < vocab_size
    if HAS_PENALTIES:  # written once by the tile kernel
        x = tl.load(work_row_ptr + offs, mask=in_vocab, other=float("-inf"))
    else:
        x = tl.load(logits_row_ptr + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        if HAS_GRAMMAR:
            x = tl.where(_allowed(bitmask_row_ptr, offs, in_vocab), x, float("-inf"))
    return x


@triton.jit
def _is_greedy(temperature, top_k):
    """Greedy rows take the first argmax and draw nothing."""
    return (temperature == 0.0) | (top_k == 1)


@triton.jit
def _tile_ids(ids_row_ptr, j, length, start, vocab_size,
              TILE: tl.constexpr, BLOCK_W: tl.constexpr):
    """Block j of a row's -1-padded token list (penalty window, logit_bias ids), and which of
    them fall in the tile starting at token `start`."""
    j_offs = j + tl.arange(0, BLOCK_W)
    tok = tl.load(ids_row_ptr + j_offs, mask=j_offs < length, other=-1)  # tok: [BLOCK_W]
    return j_offs, tok, (tok >= start) & (tok < start + TILE) & (tok < vocab_size)


@triton.jit
def _apply_penalties(logits_row_ptr, work_row_ptr, counts_row_ptr, bitmask_row_ptr,
                     window_row_ptr, window_len, bias_ids_row_ptr, bias_values_row_ptr,
                     bias_len, rep, freq, pres, start, x, vocab_size,
                     HAS_GRAMMAR: tl.constexpr, TILE: tl.constexpr, BLOCK_W: tl.constexpr):
    """The tile's window tokens penalised, then its logit_bias added; returns the tile.

    Through the row's scratch: the tile is stored, the counters of its window tokens zeroed,
    counted with atomics, then every occurrence writes the same penalised value (idempotent,
    so duplicates do not race); each phase behind a barrier. Only this program touches the
    tile's tokens."""
    offs = start + tl.arange(0, TILE)
    tl.store(work_row_ptr + offs, x, mask=offs < vocab_size)
    for phase in tl.static_range(3):
        tl.debug_barrier()
        for w0 in range(0, window_len, BLOCK_W):
            _, tok, mine = _tile_ids(window_row_ptr, w0, window_len, start, vocab_size, TILE,
                                     BLOCK_W)
            if phase == 0:
                tl.store(counts_row_ptr + tok, tl.zeros_like(tok).to(tl.int32), mask=mine)
            elif phase == 1:
                tl.atomic_add(counts_row_ptr + tok, tl.full(tok.shape, 1, tl.int32), mask=mine)
            else:
                c = tl.load(counts_row_ptr + tok, mask=mine, other=0, volatile=True)
                v = tl.load(logits_row_ptr + tok, mask=mine, other=0.0).to(tl.float32)
                v = tl.where(v <= 0.0, v * rep, tl.math.div_rn(v, rep))
                v = v - (c.to(tl.float32) * freq + pres)
                if HAS_GRAMMAR:
                    v = tl.where(_allowed(bitmask_row_ptr, tok, mine), v, float("-inf"))
                tl.store(work_row_ptr + tok, v, mask=mine)
    tl.debug_barrier()
    # logit_bias on the penalised values (ids unique in a row: no two lanes share one).
    for b0 in range(0, bias_len, BLOCK_W):
        b_offs, tok, mine = _tile_ids(bias_ids_row_ptr, b0, bias_len, start, vocab_size, TILE,
                                      BLOCK_W)
        bias = tl.load(bias_values_row_ptr + b_offs, mask=mine, other=0.0)
        v = tl.load(work_row_ptr + tok, mask=mine, other=0.0, volatile=True)
        tl.store(work_row_ptr + tok, v + bias, mask=mine)
    tl.debug_barrier()
    return tl.load(work_row_ptr + offs, mask=offs < vocab_size, other=float("-inf"),
                   volatile=True)


@triton.jit
def _tile_candidates(x, cand_keys_ptr,
                     TILE: tl.constexpr, CANDIDATES: tl.constexpr, PIVOTS: tl.constexpr):
    """Stores the keys of the tile's CANDIDATES largest finite tokens (ties to the lowest
    ids; unused slots KEY_NONE: the thresholds need the values only) and returns the key no
    other finite token of the tile exceeds (KEY_NONE when every finite token is a
    candidate)."""
    finite = x > float("-inf")
    keys = tl.where(finite, _ordered_key(x), KEY_NONE)  # keys: [TILE]
    n_finite = tl.sum(finite.to(tl.int32))
    # Largest c with count(key >= c) >= CANDIDATES, by pivots in registers; KEY_NONE
    # qualifies (every lane counts), so the bracket starts there.
    lo = tl.full([], KEY_NONE, tl.int64)
    hi = tl.where(n_finite > CANDIDATES, tl.max(keys).to(tl.int64) + 1, lo + 1)
    steps = tl.arange(0, PIVOTS).to(tl.int64) + 1
    while hi - lo > 1:
        pivots = lo + ((hi - lo) * steps) // (PIVOTS + 1)  # [P] increasing, in (lo, hi)
        counts = tl.sum((keys[:, None] >= pivots.to(tl.int32)[None, :]).to(tl.int32), axis=0)
        ok = counts >= CANDIDATES
        new_lo = tl.max(tl.where(ok, pivots, lo))
        hi = tl.min(tl.where(ok, hi, pivots))
        lo = new_lo
    chosen = finite & (keys >= lo.to(tl.int32))
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # ascending ids first among ties
    chosen = chosen & (slot < CANDIDATES)
    tl.store(cand_keys_ptr + slot, keys, mask=chosen)
    n_chosen = tl.sum(chosen.to(tl.int32))
    slots = tl.arange(0, CANDIDATES)
    tl.store(cand_keys_ptr + slots, tl.full([CANDIDATES], KEY_NONE, tl.int32),
             mask=slots >= n_chosen)
    return tl.where(n_finite > n_chosen, lo.to(tl.int32), KEY_NONE)


# Batch-dependent values are not specialised on, so the variants warmed at load are all a
# model's steps launch (kernels/warmup.py).
@triton.jit(do_not_specialize=["logits_row_stride", "window_row_stride", "window_len",
                               "bias_row_stride", "bias_len", "bitmask_row_stride",
                               "num_top", "plane"])
def _tile_kernel(
    logits_ptr,          # [B, V] fp32 / bf16 / fp16
    logits_row_stride,
    work_ptr,            # [B, V] fp32 scratch: processed logits (HAS_PENALTIES)
    counts_ptr,          # [B, V] int32 scratch: window counts, touched at window tokens only
    temperature_ptr, top_k_ptr, top_p_ptr,              # [B]
    rep_penalty_ptr, freq_penalty_ptr, pres_penalty_ptr,  # [B] fp32
    window_ptr,          # [B, W] int64, -1 padded
    window_row_stride,
    window_len,
    bias_ids_ptr,        # [B, L] int64 logit_bias token ids, -1 padded, unique in a row
    bias_values_ptr,     # [B, L] fp32 (-inf bans)
    bias_row_stride,
    bias_len,
    bitmask_ptr,         # [B, ceil(V / 32)] int32
    bitmask_row_stride,
    stats_ptr,           # [4, B, T] fp32 out: raw max, raw sum-exp, processed max and mass
    stat_ids_ptr,        # [2, B, T] int32 out: processed argmax, finite count
    plane,               # B * T: the stride between the stats' planes
    top_values_ptr,      # [B, T, num_top] fp32 out: the tile's top raw logits
    top_ids_ptr,         # [B, T, num_top] int32 out
    cand_keys_ptr,       # [B, T, CANDIDATES] int32 out: candidates' ordered keys
    floors_ptr,          # [B, T] int32 out: the key no non-candidate exceeds
    vocab_size,
    num_top,
    HAS_PENALTIES: tl.constexpr, HAS_GRAMMAR: tl.constexpr, TILE: tl.constexpr,
    BLOCK_W: tl.constexpr, CANDIDATES: tl.constexpr, PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    num_tiles = tl.num_programs(1)
    at = row * num_tiles + tile  # this tile's entry in the [B, T] outputs
    start = tile * TILE
    offs = start + tl.arange(0, TILE)
    in_vocab = offs < vocab_size
    logits_row_ptr = logits_ptr + row * logits_row_stride
    bitmask_row_ptr = bitmask_ptr + row * bitmask_row_stride
    NEG_INF: tl.constexpr = float("-inf")

    raw = tl.load(logits_row_ptr + offs, mask=in_vocab, other=NEG_INF).to(tl.float32)
    raw_m = tl.max(raw)
    tl.store(stats_ptr + at, raw_m)
    tl.store(stats_ptr + plane + at, tl.sum(tl.exp(raw - tl.where(raw_m == NEG_INF, 0.0, raw_m))))

    # Top-N raw logits: N argmax passes over the tokens ordered after the previous pick
    # (descending value, ascending id).
    prev_val = tl.full([], float("inf"), tl.float32)
    prev_idx = tl.full([], -1, tl.int32)
    for n in range(num_top):
        after = (raw < prev_val) | ((raw == prev_val) & (offs > prev_idx))
        pick = tl.where(after, raw, NEG_INF)
        prev_val = tl.max(pick)
        prev_idx = start + tl.argmax(pick, 0)
        tl.store(top_values_ptr + at * num_top + n, prev_val)
        tl.store(top_ids_ptr + at * num_top + n, prev_idx)

    x = raw
    if HAS_GRAMMAR:
        x = tl.where(_allowed(bitmask_row_ptr, offs, in_vocab), x, NEG_INF)
    if HAS_PENALTIES:
        x = _apply_penalties(
            logits_row_ptr, work_ptr + row * vocab_size, counts_ptr + row * vocab_size,
            bitmask_row_ptr, window_ptr + row * window_row_stride, window_len,
            bias_ids_ptr + row * bias_row_stride, bias_values_ptr + row * bias_row_stride,
            bias_len, tl.load(rep_penalty_ptr + row), tl.load(freq_penalty_ptr + row),
            tl.load(pres_penalty_ptr + row), start, x, vocab_size, HAS_GRAMMAR, TILE, BLOCK_W)
    best = tl.max(x)
    tl.store(stats_ptr + 2 * plane + at, best)
    tl.store(stats_ptr + 3 * plane + at, tl.sum(tl.exp(x - tl.where(best == NEG_INF, 0.0, best))))
    tl.store(stat_ids_ptr + at, start + tl.argmax(x, 0))
    n_finite = tl.sum((x > NEG_INF).to(tl.int32))
    tl.store(stat_ids_ptr + plane + at, n_finite)

    # Candidates for the row's top_k / top_p thresholds, where it has either.
    top_k = tl.load(top_k_ptr + row)
    greedy = _is_greedy(tl.load(temperature_ptr + row), top_k)
    floor = tl.full([], KEY_NONE, tl.int32)
    if (greedy == 0) & ((top_k > 0) | (tl.load(top_p_ptr + row) < 1.0)):
        floor = _tile_candidates(x, cand_keys_ptr + at * CANDIDATES, TILE, CANDIDATES, PIVOTS)
    tl.store(floors_ptr + at, floor)


@triton.jit(do_not_specialize=["logits_row_stride", "bitmask_row_stride"])
def _race_kernel(
    logits_ptr,          # [B, V] fp32 / bf16 / fp16
    logits_row_stride,
    work_ptr,            # [B, V] fp32: processed logits (HAS_PENALTIES)
    bitmask_ptr,         # [B, ceil(V / 32)] int32
    bitmask_row_stride,
    processed_ptr,       # [B, V] fp32 debug output: the logits the draw saw (WRITE_PROCESSED)
    temperature_ptr, top_k_ptr, min_p_ptr,  # [B]
    seeds_ptr, offsets_ptr,                 # [B] int64
    row_max_ptr,         # [B] fp32: the processed max (the merge's)
    row_thr_ptr,         # [B] int32: the top_k / top_p threshold key (the merge's)
    race_scores_ptr,     # [B, T] fp32 out: the tile's best score
    race_ids_ptr,        # [B, T] int32 out: its token
    vocab_size,
    HAS_PENALTIES: tl.constexpr, HAS_GRAMMAR: tl.constexpr, WRITE_PROCESSED: tl.constexpr,
    TILE: tl.constexpr,
):
    """The exponential race on the tile's survivors: score p_j / E_j (p unnormalised)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    at = row * tl.num_programs(1) + tile
    offs = tile * TILE + tl.arange(0, TILE)
    x = _load_processed(logits_ptr + row * logits_row_stride, work_ptr + row * vocab_size,
                        bitmask_ptr + row * bitmask_row_stride, offs, vocab_size,
                        HAS_PENALTIES, HAS_GRAMMAR)  # x: [TILE]
    temperature = tl.load(temperature_ptr + row)
    if _is_greedy(temperature, tl.load(top_k_ptr + row)):
        if WRITE_PROCESSED:  # greedy rows: penalties, bias and mask only
            tl.store(processed_ptr + row * vocab_size + offs, x, mask=offs < vocab_size)
    else:
        m = tl.load(row_max_ptr + row)
        keep = (x > float("-inf")) & (_ordered_key(x) >= tl.load(row_thr_ptr + row))
        keep = keep & (tl.exp(x - m) >= tl.load(min_p_ptr + row))  # p / p_max
        e = -tl.log(_uniform(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row), offs))
        score = tl.where(keep, tl.exp(tl.math.div_rn(x - m, temperature)) / e, -1.0)
        tl.store(race_scores_ptr + at, tl.max(score))
        tl.store(race_ids_ptr + at, tile * TILE + tl.argmax(score, 0))
        if WRITE_PROCESSED:
            tl.store(processed_ptr + row * vocab_size + offs,
                     tl.where(keep, tl.math.div_rn(x, temperature), float("-inf")),
                     mask=offs < vocab_size)
