"""The CPU sampler's draw by kiln's C kernels (csrc/race.c): sample_ref's exponential race over
whole rows, the Philox stream bit for bit, 20-50x faster than in torch."""

from __future__ import annotations

import os

import torch

from kiln.runtime.backends.cpu import library

THREADS = os.cpu_count() or 1  # read once: os.cpu_count() costs ~12 us, a call per step


def race(
    x: torch.Tensor,  # [R, V] fp32, values contiguous: the processed logits
    m: torch.Tensor,  # [R] fp32: each row's max
    thr: torch.Tensor,  # [R] fp32: the top-k / top-p threshold (-inf: none)
    temperature: torch.Tensor,  # [R] fp32
    min_p: torch.Tensor | None,  # [R] fp32, or None: no min_p
    seeds: torch.Tensor,  # [R] int64
    steps: torch.Tensor,  # [R] int64
) -> torch.Tensor:  # [R] int64: each row's winner (0 where no token survives)
    R, V = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1
    f32 = [t.contiguous().to(torch.float32) for t in (m, thr, temperature)]
    mp = min_p.contiguous().to(torch.float32) if min_p is not None else None
    seeds, steps = seeds.contiguous(), steps.contiguous()
    tokens = torch.empty(R, dtype=torch.int64)
    if library.load().kiln_race(x.data_ptr(), x.stride(0), R, V, *(t.data_ptr() for t in f32),
                                mp.data_ptr() if mp is not None else None, seeds.data_ptr(),
                                steps.data_ptr(), tokens.data_ptr(), THREADS):
        raise MemoryError(f"no scratch for the race over {R} rows")
    return tokens


def top_p_threshold(
    x: torch.Tensor,  # [R, V] fp32, values contiguous: the processed logits
    m: torch.Tensor,  # [R] fp32: each row's max
    top_p: torch.Tensor,  # [R] fp32 (>= 1: no threshold)
) -> torch.Tensor:  # [R] fp32: keep x >= it (-inf where top_p >= 1)
    R, V = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1
    m, top_p = m.contiguous().to(torch.float32), top_p.contiguous().to(torch.float32)
    thr = torch.empty(R, dtype=torch.float32)
    if library.load().kiln_top_p_threshold(x.data_ptr(), x.stride(0), R, V, m.data_ptr(),
                                           top_p.data_ptr(), thr.data_ptr(),
                                           THREADS):
        raise MemoryError(f"no scratch for top_p over {R} rows")
    return thr


def row_stats(x: torch.Tensor  # [R, V] fp32, values contiguous
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's max [R] fp32, its first index [R] int64 and log(sum(exp(x - max))) [R]
    fp32: a token's logprob is (x - max) - that, log_softmax without its [R, V] output."""
    R, V = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1
    m, log_sum = torch.empty(R, dtype=torch.float32), torch.empty(R, dtype=torch.float32)
    argmax = torch.empty(R, dtype=torch.int64)
    library.load().kiln_row_stats(x.data_ptr(), x.stride(0), R, V, m.data_ptr(),
                                  argmax.data_ptr(), log_sum.data_ptr(), THREADS)
    return m, argmax, log_sum


class CpuDraw:
    """What sample_ref hands to kiln's C kernels on the CPU: the rows' max, argmax and
    log-sum-exp (torch's log_softmax and max took 8 ms at 64 x 49,152), and rows without
    top_k, whose survivors are found and drawn over whole rows (top_p by a search over the
    values, the race over every survivor; torch's topk and scatters took 2-7 ms a row)."""

    race = staticmethod(race)
    top_p_threshold = staticmethod(top_p_threshold)
    row_stats = staticmethod(row_stats)
