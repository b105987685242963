"""The sampler's per-row kernels (grid: rows): the merge of the tiles' partial results in tile
order, the top_k / top_p thresholds, and the pick of the race's winner. kernels/sampling.py
says how the stages fit together."""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.sampling_tiles import (
    KEY_NEG_INF,
    KEY_NONE,
    _is_greedy,
    _key_value,
    _load_processed,
    _ordered_key,
)

INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _keys_and_mass(j, cand_keys_row_ptr, num_cands, logits_row_ptr, work_row_ptr,
                   bitmask_row_ptr, vocab_size, m,
                   FROM_CANDIDATES: tl.constexpr, HAS_PENALTIES: tl.constexpr,
                   HAS_GRAMMAR: tl.constexpr, BLOCK: tl.constexpr):
    """Block j of the row's candidates or of its whole processed row: ordered keys and
    masses exp(x - m) (0 for -inf and empty slots)."""
    offs = j + tl.arange(0, BLOCK)
    if FROM_CANDIDATES:
        keys = tl.load(cand_keys_row_ptr + offs, mask=offs < num_cands, other=KEY_NONE)
        x = _key_value(keys)
    else:
        x = _load_processed(logits_row_ptr, work_row_ptr, bitmask_row_ptr, offs, vocab_size,
                            HAS_PENALTIES, HAS_GRAMMAR)
        keys = _ordered_key(x)
    return keys, tl.where(keys > KEY_NEG_INF, tl.exp(x - m), 0.0)


@triton.jit
def _mass_at_least(t, cand_keys_row_ptr, num_cands, m, BLOCK: tl.constexpr):
    """sum exp(x - m) over the candidates with key >= t."""
    mass = tl.zeros([], dtype=tl.float32)
    for j in range(0, num_cands, BLOCK):
        keys, w = _keys_and_mass(j, cand_keys_row_ptr, num_cands, cand_keys_row_ptr,
                                 cand_keys_row_ptr, cand_keys_row_ptr, 0, m,
                                 True, False, False, BLOCK)
        mass += tl.sum(tl.where(keys >= t, w, 0.0))
    return mass


@triton.jit
def _pivot_search(cand_keys_row_ptr, num_cands, logits_row_ptr, work_row_ptr, bitmask_row_ptr,
                  vocab_size, lo, hi, lo_mass, k, target_mass, m, need_mass,
                  BY_COUNT: tl.constexpr, FROM_CANDIDATES: tl.constexpr,
                  HAS_PENALTIES: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
                  BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """Largest key t in [lo, hi) with count(key >= t) >= k (BY_COUNT) or mass >= target_mass,
    over the candidates or the whole row. Invariant: lo qualifies, hi does not. Also returns
    mass(key >= t). Each round counts and weighs the tokens above NUM_PIVOTS pivots and
    shrinks the bracket (NUM_PIVOTS + 1)x: with 8, exact after at most 11 rounds."""
    n = num_cands if FROM_CANDIDATES else vocab_size
    steps = tl.arange(0, NUM_PIVOTS).to(tl.int64) + 1
    while hi - lo > 1:
        pivots = lo + ((hi - lo) * steps) // (NUM_PIVOTS + 1)  # [P] increasing, in (lo, hi)
        pivots_i32 = pivots.to(tl.int32)  # keys span int32; only the midpoint math needs int64
        counts = tl.zeros([NUM_PIVOTS], dtype=tl.int32)
        masses = tl.zeros([NUM_PIVOTS], dtype=tl.float32)
        for j in range(0, n, BLOCK):
            keys, w = _keys_and_mass(j, cand_keys_row_ptr, num_cands, logits_row_ptr,
                                     work_row_ptr, bitmask_row_ptr, vocab_size, m,
                                     FROM_CANDIDATES, HAS_PENALTIES, HAS_GRAMMAR, BLOCK)
            above = keys[:, None] >= pivots_i32[None, :]  # above: [BLOCK, P]
            counts += tl.sum(above.to(tl.int32), axis=0)
            if need_mass:
                masses += tl.sum(tl.where(above, w[:, None], 0.0), axis=0)
        ok = (counts >= k) if BY_COUNT else (masses >= target_mass)
        new_lo = tl.max(tl.where(ok, pivots, lo))
        lo_mass = tl.min(tl.where(ok, masses, lo_mass))
        hi = tl.min(tl.where(ok, hi, pivots))
        lo = new_lo
    return lo, lo_mass


@triton.jit
def _top_logprobs(top_values_row_ptr, top_ids_row_ptr, num_entries, lse, out_ids_ptr,
                  out_lps_ptr, num_top, BLOCK: tl.constexpr):
    """The row's top-N raw logprobs from every tile's top N: N picks, each the largest entry
    ordered after the previous one (descending value, ascending id)."""
    prev_val = tl.full([], float("inf"), tl.float32)
    prev_idx = tl.full([], -1, tl.int32)
    for n in range(num_top):
        n_val = tl.full([], float("-inf"), tl.float32)
        n_idx = tl.full([], INT32_MAX, tl.int32)
        for j in range(0, num_entries, BLOCK):
            offs = j + tl.arange(0, BLOCK)
            vals = tl.load(top_values_row_ptr + offs, mask=offs < num_entries,
                           other=float("-inf"))
            ids = tl.load(top_ids_row_ptr + offs, mask=offs < num_entries, other=INT32_MAX)
            after = ((vals < prev_val) | ((vals == prev_val) & (ids > prev_idx))) & (
                ids < INT32_MAX)
            vals = tl.where(after, vals, float("-inf"))
            blk_val = tl.max(vals)
            blk_idx = tl.min(tl.where(after & (vals == blk_val), ids, INT32_MAX))
            better = (blk_val > n_val) | ((blk_val == n_val) & (blk_idx < n_idx))
            n_idx = tl.where(better, blk_idx, n_idx)
            n_val = tl.maximum(n_val, blk_val)
        tl.store(out_ids_ptr + n, n_idx.to(tl.int64))
        tl.store(out_lps_ptr + n, n_val - lse)
        prev_val, prev_idx = n_val, n_idx


@triton.jit(do_not_specialize=["logits_row_stride", "bitmask_row_stride", "num_tiles",
                               "num_top", "plane"])
def _merge_kernel(
    logits_ptr,          # [B, V] fp32 / bf16 / fp16
    logits_row_stride,
    work_ptr,            # [B, V] fp32: processed logits (HAS_PENALTIES)
    bitmask_ptr,         # [B, ceil(V / 32)] int32
    bitmask_row_stride,
    temperature_ptr, top_k_ptr, top_p_ptr,  # [B]
    stats_ptr,           # [4, B, T] fp32: raw max, raw sum-exp, processed max and mass
    stat_ids_ptr,        # [2, B, T] int32: processed argmax, finite count
    plane,               # B * T
    top_values_ptr,      # [B, T, num_top] fp32
    top_ids_ptr,         # [B, T, num_top] int32
    cand_keys_ptr,       # [B, T, CANDIDATES] int32
    floors_ptr,          # [B, T] int32
    row_max_ptr,         # [B] fp32 out: processed max
    row_thr_ptr,         # [B] int32 out: threshold key
    lse_ptr,             # [B] fp32 out: raw log-sum-exp
    token_ids_ptr,       # [B] int64 out (greedy rows)
    logprobs_ptr,        # [B] fp32 out (greedy rows)
    out_top_ids_ptr,     # [B, num_top] int64 out
    out_top_lps_ptr,     # [B, num_top] fp32 out
    vocab_size,
    num_tiles,
    num_top,
    HAS_PENALTIES: tl.constexpr, HAS_GRAMMAR: tl.constexpr, CANDIDATES: tl.constexpr,
    NUM_PIVOTS: tl.constexpr, BLOCK: tl.constexpr, TILES_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    NEG_INF: tl.constexpr = float("-inf")
    logits_row_ptr = logits_ptr + row * logits_row_stride
    work_row_ptr = work_ptr + row * vocab_size
    bitmask_row_ptr = bitmask_ptr + row * bitmask_row_stride
    at = row * num_tiles

    # The tiles' partial results, folded in tile order.
    raw_m = tl.full([], NEG_INF, tl.float32)
    raw_s = tl.zeros([], dtype=tl.float32)
    best = tl.full([], NEG_INF, tl.float32)
    best_idx = tl.zeros([], dtype=tl.int32)
    z = tl.zeros([], dtype=tl.float32)
    n_finite = tl.zeros([], dtype=tl.int32)
    floor = tl.full([], KEY_NONE, tl.int32)
    for t0 in range(0, num_tiles, TILES_BLOCK):
        t = t0 + tl.arange(0, TILES_BLOCK)
        ok = t < num_tiles
        tile_m = tl.load(stats_ptr + at + t, mask=ok, other=NEG_INF)
        tile_s = tl.load(stats_ptr + plane + at + t, mask=ok, other=0.0)
        tile_best = tl.load(stats_ptr + 2 * plane + at + t, mask=ok, other=NEG_INF)
        tile_z = tl.load(stats_ptr + 3 * plane + at + t, mask=ok, other=0.0)
        tile_idx = tl.load(stat_ids_ptr + at + t, mask=ok, other=0)
        n_finite += tl.sum(tl.load(stat_ids_ptr + plane + at + t, mask=ok, other=0))
        floor = tl.maximum(floor, tl.max(tl.load(floors_ptr + at + t, mask=ok, other=KEY_NONE)))

        new_m = tl.maximum(raw_m, tl.max(tile_m))
        safe = tl.where(new_m == NEG_INF, 0.0, new_m)
        raw_s = raw_s * tl.exp(raw_m - safe) + tl.sum(tile_s * tl.exp(tile_m - safe))
        raw_m = new_m
        blk_best = tl.max(tile_best)
        blk_idx = tl.min(tl.where(ok & (tile_best == blk_best), tile_idx, INT32_MAX))
        best_idx = tl.where(blk_best > best, blk_idx, best_idx)
        new_best = tl.maximum(best, blk_best)
        safe = tl.where(new_best == NEG_INF, 0.0, new_best)
        z = z * tl.exp(best - safe) + tl.sum(tile_z * tl.exp(tile_best - safe))
        best = new_best
    lse = raw_m + tl.log(raw_s)
    tl.store(lse_ptr + row, lse)
    _top_logprobs(top_values_ptr + at * num_top, top_ids_ptr + at * num_top,
                  num_tiles * num_top, lse, out_top_ids_ptr + row * num_top,
                  out_top_lps_ptr + row * num_top, num_top, BLOCK)

    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    if _is_greedy(temperature, top_k):
        tl.store(token_ids_ptr + row, best_idx.to(tl.int64))
        tl.store(logprobs_ptr + row, tl.load(logits_row_ptr + best_idx).to(tl.float32) - lse)
    else:
        # Thresholds from the candidates where they decide them: every token above the
        # floor is a candidate, so a threshold above it is exact; otherwise (ties at a
        # tile's last candidate, top_k > CANDIDATES, a wide nucleus) the whole row decides.
        cands_row_ptr = cand_keys_ptr + at * CANDIDATES
        num_cands = num_tiles * CANDIDATES
        m = tl.where(best == NEG_INF, 0.0, best)
        hi0 = _ordered_key(best).to(tl.int64) + 1
        thr = tl.full([], KEY_NEG_INF, tl.int64)  # keep every finite token
        top_p = tl.load(top_p_ptr + row)
        need_mass = top_p < 1.0
        if (top_k > 0) & (top_k < n_finite):
            # The candidates hold the k largest when k <= CANDIDATES, or every finite token.
            by_cands = (top_k <= CANDIDATES) | (floor == KEY_NONE)
            t, t_mass = thr, z
            if by_cands:
                t, t_mass = _pivot_search(cands_row_ptr, num_cands, logits_row_ptr,
                                          work_row_ptr, bitmask_row_ptr, vocab_size, thr, hi0,
                                          z, top_k, 0.0, m, need_mass, True, True,
                                          HAS_PENALTIES, HAS_GRAMMAR, BLOCK, NUM_PIVOTS)
            if (by_cands == 0) | (t <= floor):
                t, t_mass = _pivot_search(cands_row_ptr, num_cands, logits_row_ptr,
                                          work_row_ptr, bitmask_row_ptr, vocab_size, thr, hi0,
                                          z, top_k, 0.0, m, need_mass, True, False,
                                          HAS_PENALTIES, HAS_GRAMMAR, BLOCK, NUM_PIVOTS)
            thr, z = t, t_mass
        if need_mass:
            target = top_p * z
            lo, lo_mass = thr, z
            if thr <= floor:
                lo = floor.to(tl.int64) + 1
                lo_mass = _mass_at_least(lo.to(tl.int32), cands_row_ptr, num_cands, m, BLOCK)
            if lo_mass >= target:
                thr, z = _pivot_search(cands_row_ptr, num_cands, logits_row_ptr, work_row_ptr,
                                       bitmask_row_ptr, vocab_size, lo, hi0, lo_mass, 0,
                                       target, m, True, False, True,
                                       HAS_PENALTIES, HAS_GRAMMAR, BLOCK, NUM_PIVOTS)
            else:
                thr, z = _pivot_search(cands_row_ptr, num_cands, logits_row_ptr, work_row_ptr,
                                       bitmask_row_ptr, vocab_size, thr, hi0, z, 0,
                                       target, m, True, False, False,
                                       HAS_PENALTIES, HAS_GRAMMAR, BLOCK, NUM_PIVOTS)
        tl.store(row_max_ptr + row, m)
        tl.store(row_thr_ptr + row, thr.to(tl.int32))


@triton.jit(do_not_specialize=["logits_row_stride", "num_tiles"])
def _pick_kernel(
    logits_ptr,          # [B, V] fp32 / bf16 / fp16
    logits_row_stride,
    temperature_ptr, top_k_ptr,  # [B]
    race_scores_ptr,     # [B, T] fp32: each tile's best score
    race_ids_ptr,        # [B, T] int32: its token
    lse_ptr,             # [B] fp32
    token_ids_ptr,       # [B] int64 out (sampled rows)
    logprobs_ptr,        # [B] fp32 out (sampled rows)
    num_tiles,
    TILES_BLOCK: tl.constexpr,
):
    """A sampled row's token: the best score of all tiles, the lowest id among equals."""
    row = tl.program_id(0).to(tl.int64)
    if _is_greedy(tl.load(temperature_ptr + row), tl.load(top_k_ptr + row)) == 0:
        score = tl.full([], float("-inf"), tl.float32)
        token = tl.full([], INT32_MAX, tl.int32)
        for t0 in range(0, num_tiles, TILES_BLOCK):
            t = t0 + tl.arange(0, TILES_BLOCK)
            ok = t < num_tiles
            scores = tl.load(race_scores_ptr + row * num_tiles + t, mask=ok,
                             other=float("-inf"))
            ids = tl.load(race_ids_ptr + row * num_tiles + t, mask=ok, other=INT32_MAX)
            blk = tl.max(scores)
            blk_id = tl.min(tl.where(ok & (scores == blk), ids, INT32_MAX))
            token = tl.where(blk > score, blk_id, token)
            score = tl.maximum(score, blk)
        tl.store(token_ids_ptr + row, token.to(tl.int64))
        raw = tl.load(logits_ptr + row * logits_row_stride + token).to(tl.float32)
        tl.store(logprobs_ptr + row, raw - tl.load(lse_ptr + row))
