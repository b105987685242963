"""Sampling: the fused kernel and its torch reference against a sort-based torch sampler.

`make bench` (pytest-benchmark). On CPU the kernel is skipped (interpreter timings mean
nothing) and the reference (kiln's CPU sampler) races the sort-based sampler. On CUDA each
kernel case records the GB/s of logits read (one read of the logits per step; the kernel's
extra passes are what this number tells against) in extra_info.
"""

import pytest
import torch

from kiln.kernels.sampling import sample
from kiln.kernels.sampling_metadata import SamplingMetadata
from kiln.kernels.sampling_ref import sample_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def sort_based_sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The usual torch sampler: full sort, top-k / top-p masks on the sorted row, race."""
    x = logits.float() / md.temperature[:, None]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    ranks = torch.arange(x.shape[-1], device=x.device)
    sorted_x = sorted_x.masked_fill(ranks >= md.top_k[:, None], float("-inf"))
    probs = sorted_x.softmax(-1)
    beyond_p = probs.cumsum(-1) - probs > md.top_p[:, None]  # the crossing token is kept
    probs = probs.masked_fill(beyond_p, 0.0)
    choice = (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    return order.gather(1, choice[:, None])[:, 0]


def make_case(batch: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE, DTYPE)
    full = lambda v, dtype: torch.full((batch,), v, dtype=dtype, device=DEVICE)
    md = SamplingMetadata(
        temperature=full(0.8, torch.float32), top_k=full(40, torch.int32),
        top_p=full(0.95, torch.float32), min_p=full(0.0, torch.float32),
        repetition_penalty=full(1.0, torch.float32), frequency_penalty=full(0.0, torch.float32),
        presence_penalty=full(0.0, torch.float32), window_token_ids=None,
        seeds=torch.arange(batch, device=DEVICE), offsets=full(0, torch.int64),
        grammar_bitmask=None, num_top_logprobs=0)
    return logits, md


@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("impl", ["kernel", "reference", "sort"])
def test_bench_sampling(benchmark, impl, batch, vocab):
    if impl == "kernel" and DEVICE != "cuda":
        pytest.skip("the Triton interpreter's timings mean nothing")
    logits, md = make_case(batch, vocab)
    fn = {"kernel": lambda: sample(logits, md).token_ids,
          "reference": lambda: sample_ref(logits, md).token_ids,
          "sort": lambda: sort_based_sample(logits, md)}[impl]

    def step():
        out = fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return out

    tokens = benchmark(step)
    assert tokens.shape == (batch,) and bool(((tokens >= 0) & (tokens < vocab)).all())
    benchmark.extra_info.update(device=DEVICE, dtype=str(DTYPE), batch=batch, vocab=vocab)
    if benchmark.stats is not None and DEVICE == "cuda":
        seconds = benchmark.stats.stats.mean
        benchmark.extra_info["GB/s"] = logits.numel() * logits.element_size() / seconds / 1e9
