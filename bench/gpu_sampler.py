"""bench/gpu_check.py's sampler sections: the fused sampler's tokens against sample_ref and
its draws against the filtered softmax, a sort-based torch sampler (the peer the kernel
timings compare with), and the sweep of its launch parameters at served shapes.

A section takes the check's own `line` (one figure a line) and `bench` (ms a call).
"""

from __future__ import annotations

import math

import torch

from kiln.kernels.sampling import sample, tile_size, tile_warps
from kiln.kernels.sampling_metadata import SamplingMetadata
from kiln.kernels.sampling_ref import sample_ref


def sampling_batch(B: int, V: int, dtype, device, seed=0) -> tuple[torch.Tensor, SamplingMetadata]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn((B, V), generator=g) * 3).to(device, dtype)
    rows = torch.arange(B)
    f32 = dict(dtype=torch.float32, device=device)
    temperature = torch.where(rows % 4 == 0, 0.0, 0.7 + (rows % 3) * 0.2).to(**f32)
    top_k = torch.where(rows % 5 == 1, 40, 0).to(torch.int32).to(device)
    top_p = torch.where(rows % 3 == 2, 0.9, 1.0).to(**f32)
    min_p = torch.where(rows % 7 == 3, 0.05, 0.0).to(**f32)
    ones, zeros = torch.ones(B, **f32), torch.zeros(B, **f32)
    md = SamplingMetadata(temperature, top_k, top_p, min_p, ones, zeros, zeros, None,
                          seeds=rows.to(torch.int64).to(device) * 7919,
                          offsets=torch.zeros(B, dtype=torch.int64, device=device),
                          grammar_bitmask=None, num_top_logprobs=1)
    return logits, md


def torch_sort_sampler(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The common torch sampler: temperature, a full sort, top-k and top-p masks, a draw."""
    x = logits.float() / md.temperature.clamp(min=1e-5)[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where(md.top_k > 0, md.top_k, x.shape[1]).long()
    pos = torch.arange(x.shape[1], device=x.device)[None]
    sorted_x = sorted_x.masked_fill(pos >= k[:, None], float("-inf"))
    probs = sorted_x.softmax(-1)
    cut = probs.cumsum(-1) - probs > md.top_p[:, None]
    probs = probs.masked_fill(cut, 0.0)
    return order.gather(1, torch.multinomial(probs, 1))[:, 0]


def check_sampler(device: str, dry: bool, line) -> None:
    B, V = (256, 151936) if not dry else (8, 3000)
    logits, md = sampling_batch(B, V, torch.bfloat16 if device == "cuda" else torch.float32,
                                device)
    got, want = sample(logits, md), sample_ref(logits, md)
    same = (got.token_ids == want.token_ids).float().mean().item()
    line(f"sampler {B} x {V}: tokens equal to sample_ref", f"{same:.2%}", "",
         "ok" if same == 1.0 else "FAIL")
    # Distribution: one row's filtered softmax against its draws over N seeds.
    N, V2 = (20000, 1000) if not dry else (64, 100)  # the interpreter: ~0.15 s a row
    row = torch.randn(V2, generator=torch.Generator().manual_seed(5)) * 2
    f32 = dict(dtype=torch.float32, device=device)
    md2 = SamplingMetadata(torch.full((N,), 0.8, **f32),
                           torch.full((N,), 50, dtype=torch.int32, device=device),
                           torch.full((N,), 0.95, **f32), torch.zeros(N, **f32),
                           torch.ones(N, **f32), torch.zeros(N, **f32), torch.zeros(N, **f32),
                           None, torch.arange(N, dtype=torch.int64, device=device),
                           torch.zeros(N, dtype=torch.int64, device=device), None)
    drawn = sample(row.to(device)[None].expand(N, V2).contiguous(), md2).token_ids.cpu()
    x = row / 0.8
    keep = x >= x.topk(50).values[-1]
    p = torch.where(keep, x, float("-inf")).softmax(-1)
    sp, order = p.sort(descending=True)
    keep_p = torch.zeros_like(keep)
    keep_p[order[(sp.cumsum(0) - sp) < 0.95]] = True
    p = torch.where(keep_p, p, 0.0)
    p = p / p.sum()
    freq = torch.bincount(drawn, minlength=V2).double() / N
    tv = 0.5 * (freq - p.double()).abs().sum().item()
    # E[TV] of N draws from k cells is about sqrt(k / (2 pi N)): allow 2.5 times that.
    bound = math.sqrt(int(keep_p.sum()) / N)
    line(f"sampler draws ({N}) vs filtered softmax: total variation", tv, "",
         "ok" if tv < bound else f"FAIL (>= {bound:.3f})")


def serving_batch(B: int, V: int, device, seed=0) -> tuple[torch.Tensor, SamplingMetadata]:
    """What a served batch asks of the sampler: the default model's settings (temperature
    0.2, top_k 40, top_p 0.9, min_p 0.1, repetition 1.1 over a 64-token window), bf16."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn((B, V), generator=g) * 3).to(device, torch.bfloat16)
    f32 = dict(dtype=torch.float32, device=device)

    def full(v, **kw):
        return torch.full((B,), v, **(kw or f32))
    window = torch.randint(0, V, (B, 64), generator=g).to(device)
    md = SamplingMetadata(full(0.2), full(40, dtype=torch.int32, device=device), full(0.9),
                          full(0.1), full(1.1), full(0.0), full(0.0), window,
                          seeds=torch.arange(B, dtype=torch.int64, device=device),
                          offsets=torch.zeros(B, dtype=torch.int64, device=device),
                          grammar_bitmask=None, num_top_logprobs=0)
    return logits, md


def sweep_sampler(device: str, dry: bool, line, bench) -> None:
    """The fused sampler's tile width and warps at served batch shapes, against the
    sort-based torch sampler: the data to choose the defaults by."""
    shapes = [(1, 49152), (16, 49152), (256, 49152), (1, 151936), (256, 151936)]
    configs = [(tile, warps) for tile in (256, 512, 1024, 2048) for warps in (4, 8, 16)]
    if dry:
        shapes, configs = [(2, 3000)], [(tile_size(3000), 4), (256, 4)]
    for B, V in shapes:
        default = (tile_size(V), tile_warps(tile_size(V)))
        logits, md = serving_batch(B, V, device)
        want = sample(logits, md).token_ids
        times = {}
        for tile, warps in configs:
            out = sample(logits, md, tile=tile, warps=warps)
            if not torch.equal(out.token_ids, want):
                line(f"sampler sweep {B} x {V} tile {tile} warps {warps}", "FAIL", "",
                     "tokens differ from the default launch")
                continue
            times[tile, warps] = bench(lambda t=tile, w=warps, x=logits, m=md: sample(
                x, m, tile=t, warps=w))
        sort = bench(lambda x=logits, m=md: torch_sort_sampler(x, m))
        best = min(times, key=times.get)
        default_ms = times.get(default) or bench(lambda x=logits, m=md: sample(x, m))
        line(f"sampler sweep {B} x {V}: default {default[0]}/{default[1]}", default_ms, "ms",
             f"best {best[0]}/{best[1]} {times[best]:.3f} ms; torch sort {sort:.3f} ms")
        print("    " + "  ".join(f"{t}/{w}={ms:.3f}" for (t, w), ms in sorted(times.items())),
              flush=True)
