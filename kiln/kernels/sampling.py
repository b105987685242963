"""Fused token sampling: penalties (and logit_bias) -> grammar mask -> top_k -> top_p / min_p
-> temperature -> draw, spread over the GPU at every batch size.

A row is cut into vocabulary tiles whose width follows the vocabulary only (`tile_size`),
never the batch, and every merge of the tiles' results runs in tile order: a row's token and
logprobs are the same bits alone or in any batch. Four launches (two when every row is
greedy), no sort:

1. tiles (row x tile): the raw max and sum-exp (logprobs), the tile's top-N raw logits; the
   penalties on the tile's window tokens, its logit_bias (a bias of -inf bans a token:
   min_tokens) and the grammar mask; the processed max, first argmax, mass and finite count;
   for rows with top_k or top_p, the tile's CANDIDATES largest tokens (a pivot search in
   registers, then a compaction) and the key no other token of the tile exceeds (its floor).
2. rows: the tiles folded in order (log-sum-exp, top-N logprobs, the processed max); greedy
   rows (temperature 0 or top_k 1) take the first argmax and are done. The top_k then top_p
   thresholds are pivot searches over an order-preserving int32 key of the fp32 logits, run
   over the candidates where they decide them exactly (a threshold above every tile's floor)
   and over the whole row otherwise (ties at a tile's last candidate, top_k > CANDIDATES, a
   nucleus wider than the candidates).
3. tiles: the exponential race on the survivors, token = argmax_j p_j / E_j, E_j = -log U_j,
   where U_j is Philox4x32-10 (`tl.rand`) with key `seed` and counter (token j, step).
4. rows: the best score of all tiles, the lowest token id among equals.

Ties: every token equal to a threshold is kept (top_k may keep more than k, top_p keeps the
crossing token and its equals); argmax ties go to the lowest token id. `sample_ref` is the
same pipeline in torch (also the CPU sampler): the same Philox bit for bit, evaluated on
surviving tokens only.
"""

from __future__ import annotations

import torch
import triton

from kiln.kernels import INTERPRET
from kiln.kernels.sampling_metadata import SamplerOutput, SamplingMetadata, check_inputs
from kiln.kernels.sampling_rows import _merge_kernel, _pick_kernel
from kiln.kernels.sampling_tiles import _race_kernel, _tile_kernel, _uniform

__all__ = ["sample", "tile_size", "tile_warps", "_uniform"]

BLOCK_W = 128      # window (or bias) tokens per step of the fix-up loops (not from their length)
CANDIDATES = 64    # per tile: top_k up to 64 (Ollama's 40, transformers' 50) by candidates
TILE_PIVOTS = 16   # pivots of the tile's candidate search (in registers: more, fewer rounds)
NUM_PIVOTS = 8     # pivots of the row's threshold searches
ROW_BLOCK = 1024   # candidates (or tokens) a row program reads at a time
TILES_BLOCK = 256  # tiles a row program folds at a time
RACE_WARPS = 4
ROW_WARPS = 8


def tile_size(vocab_size: int) -> int:
    """Tokens per tile: about 128 tiles a row (an H200 has 132 SMs), so one row fills the GPU;
    a function of the vocabulary only, which keeps a row's bits independent of its batch."""
    if INTERPRET:  # the interpreter runs a tile as numpy arrays: the bigger the fewer steps
        return min(triton.next_power_of_2(vocab_size), 8192)
    per_tile = max(vocab_size // 128, 1)
    return min(max(1 << (per_tile.bit_length() - 1), 256), 2048)


def tile_warps(tile: int) -> int:
    """Warps of the tile kernel: its candidate search holds [tile, TILE_PIVOTS] comparisons,
    64 a thread at most (sm_90 code with 128 spilled registers)."""
    return min(max(tile * TILE_PIVOTS // (64 * 32), 4), 16)


def sample(logits: torch.Tensor, metadata: SamplingMetadata, return_processed: bool = False,
           tile: int | None = None, warps: int | None = None,
           out: SamplerOutput | None = None) -> SamplerOutput:
    """Fused sampler over vocabulary tiles. See the module docstring. out: where to write
    the tokens and logprobs (a CUDA graph's buffers that outlive its memory pool)."""
    check_inputs(logits, metadata)
    md = metadata
    B, V = logits.shape
    N = md.num_top_logprobs
    dev = logits.device
    tile = tile or tile_size(V)
    warps = warps or tile_warps(tile)
    T = triton.cdiv(V, tile)
    i32, f32 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.float32, device=dev)
    if out is None:
        token_ids, top_ids = (torch.empty(B, *n, dtype=torch.int64, device=dev)
                              for n in ((), (N,)))
        logprobs, top_lps = (torch.empty(B, *n, **f32) for n in ((), (N,)))
    else:
        token_ids, logprobs, top_ids, top_lps = \
            out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs
        assert token_ids.shape == logprobs.shape == (B,) and top_ids.shape == (B, N)
        assert top_lps.shape == (B, N) and token_ids.dtype == top_ids.dtype == torch.int64
    processed = torch.empty(B, V, **f32) if return_processed else logits
    work, counts = logits, logits  # unused placeholders without penalties
    if md.has_penalties:
        work, counts = torch.empty(B, V, **f32), torch.empty(B, V, **i32)
    stats, stat_ids = torch.empty(4, B, T, **f32), torch.empty(2, B, T, **i32)
    tile_top_values, tile_top_ids = torch.empty(B, T, N, **f32), torch.empty(B, T, N, **i32)
    cand_keys = torch.empty(B, T, CANDIDATES, **i32)
    floors, race_ids = torch.empty(B, T, **i32), torch.empty(B, T, **i32)
    race_scores = torch.empty(B, T, **f32)
    row_max, row_thr, lse = torch.empty(B, **f32), torch.empty(B, **i32), torch.empty(B, **f32)

    has_window, has_bias = md.window_token_ids is not None, md.bias_token_ids is not None
    window = md.window_token_ids if has_window else md.seeds.view(B, 1)
    bias_ids = md.bias_token_ids if has_bias else md.seeds.view(B, 1)
    bias_values = md.bias_values if has_bias else md.temperature.view(B, 1)
    bitmask = md.grammar_bitmask if md.has_grammar else md.top_k.view(B, 1)
    flags = dict(HAS_PENALTIES=md.has_penalties, HAS_GRAMMAR=md.has_grammar)
    _tile_kernel[(B, T)](
        logits, logits.stride(0), work, counts, md.temperature, md.top_k, md.top_p,
        md.repetition_penalty, md.frequency_penalty, md.presence_penalty,
        window, window.stride(0), window.shape[1] if has_window else 0,
        bias_ids, bias_values, bias_ids.stride(0), bias_ids.shape[1] if has_bias else 0,
        bitmask, bitmask.stride(0), stats, stat_ids, B * T, tile_top_values, tile_top_ids,
        cand_keys, floors, V, N, **flags, TILE=tile, BLOCK_W=BLOCK_W,
        CANDIDATES=CANDIDATES, PIVOTS=TILE_PIVOTS, num_warps=warps)
    _merge_kernel[(B,)](
        logits, logits.stride(0), work, bitmask, bitmask.stride(0),
        md.temperature, md.top_k, md.top_p, stats, stat_ids, B * T, tile_top_values,
        tile_top_ids, cand_keys, floors, row_max, row_thr, lse, token_ids, logprobs,
        top_ids, top_lps, V, T, N, **flags, CANDIDATES=CANDIDATES, NUM_PIVOTS=NUM_PIVOTS,
        BLOCK=ROW_BLOCK, TILES_BLOCK=TILES_BLOCK, num_warps=ROW_WARPS)
    if md.all_greedy and not return_processed:
        return SamplerOutput(token_ids, logprobs, top_ids, top_lps, None)
    _race_kernel[(B, T)](
        logits, logits.stride(0), work, bitmask, bitmask.stride(0), processed,
        md.temperature, md.top_k, md.min_p, md.seeds, md.offsets, row_max, row_thr,
        race_scores, race_ids, V, **flags, WRITE_PROCESSED=return_processed, TILE=tile,
        num_warps=RACE_WARPS)
    _pick_kernel[(B,)](
        logits, logits.stride(0), md.temperature, md.top_k, race_scores, race_ids, lse,
        token_ids, logprobs, T, TILES_BLOCK=TILES_BLOCK, num_warps=ROW_WARPS)
    return SamplerOutput(token_ids, logprobs, top_ids, top_lps,
                         processed if return_processed else None)
