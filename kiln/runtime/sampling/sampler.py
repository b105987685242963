"""The runtime side of sampling: builds the batch's SamplingMetadata from its requests and
calls the fused Triton kernel (CUDA) or its torch reference (CPU).

Random streams: a seeded request draws from (seed, index of the token in its reply), so its
tokens depend neither on other requests nor on what ran before it. Unseeded requests share
one server generator that carries on; it hands each row a fresh stream every step.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.kernels.sampling import SamplerOutput, SamplingMetadata, sample
from kiln.kernels.sampling_ref import sample_ref
from kiln.runtime.engine.request import Request, TokenLogprob
from kiln.runtime.sampling.grammar import build_grammar_bitmask
from kiln.runtime.sampling.penalty_window import window_tokens


class Sampler:
    def __init__(self, device: torch.device, use_triton: bool, seed: int | None = None):
        self.device, self.use_triton = device, use_triton
        self.server_rng = np.random.default_rng(seed)

    def build_metadata(self, requests: list[Request], vocab_size: int) -> SamplingMetadata:
        rows = [r.sampling for r in requests]
        seeds, offsets, windows = [], [], []
        for r in requests:
            sp = r.sampling
            if sp.seed is not None:
                seeds.append(sp.seed)
                offsets.append(r.num_output_tokens)
            elif sp.is_greedy:
                seeds.append(0)
                offsets.append(0)
            else:
                seeds.append(int(self.server_rng.integers(0, 2**63 - 1)))
                offsets.append(0)
            windows.append(window_tokens(sp.repeat_last_n, r.output_token_ids, r.window_prefix)
                           if sp.has_penalties else [])
        width = max(len(w) for w in windows)
        window_ids = None
        if width:
            window_ids = torch.full((len(requests), width), -1, dtype=torch.int64)
            for i, w in enumerate(windows):
                if w:
                    window_ids[i, :len(w)] = torch.tensor(w, dtype=torch.int64)
            window_ids = window_ids.to(self.device)
        n_top = max((r.num_top_logprobs or 0) for r in requests)

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        return SamplingMetadata(
            temperature=col([p.temperature for p in rows], torch.float32),
            # top_k >= vocab keeps everything: clamp so any stored value fits in int32.
            top_k=col([min(p.top_k, vocab_size) for p in rows], torch.int32),
            top_p=col([p.top_p for p in rows], torch.float32),
            min_p=col([p.min_p for p in rows], torch.float32),
            repetition_penalty=col([p.repetition_penalty for p in rows], torch.float32),
            frequency_penalty=col([p.frequency_penalty for p in rows], torch.float32),
            presence_penalty=col([p.presence_penalty for p in rows], torch.float32),
            window_token_ids=window_ids,
            seeds=col(seeds, torch.int64),
            offsets=col(offsets, torch.int64),
            grammar_bitmask=build_grammar_bitmask([r.grammar for r in requests], vocab_size,
                                                  self.device),
            num_top_logprobs=n_top,
        )

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        meta = self.build_metadata(requests, logits.shape[-1])
        return (sample if self.use_triton else sample_ref)(logits, meta)


def to_token_logprobs(out: SamplerOutput, requests: list[Request]) -> list[TokenLogprob | None]:
    """Per row, the chosen token's raw logprob and its top-N, for rows that asked."""
    if not any(r.num_top_logprobs is not None for r in requests):
        return [None] * len(requests)
    ids = out.token_ids.tolist()
    lps = out.logprobs.tolist()
    top_ids = out.top_token_ids.tolist()
    top_lps = out.top_logprobs.tolist()
    result = []
    for i, r in enumerate(requests):
        if r.num_top_logprobs is None:
            result.append(None)
            continue
        n = r.num_top_logprobs
        result.append(TokenLogprob(ids[i], lps[i], list(zip(top_ids[i][:n], top_lps[i][:n]))))
    return result
