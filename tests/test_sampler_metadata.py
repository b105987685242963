"""Sampler.columns, as sent (Sampler.send), against a row-by-row construction of each: the server's
draws in row order (one numpy call for many rows gives what a call per row gives), the
penalty windows and the logit_bias padded, at a few rows (filled one by one) and at many
(filled in one assignment)."""

import numpy as np
import pytest
import torch

from kiln.runtime.engine.engine_request import RequestOptions
from kiln.runtime.engine.request import Request
from kiln.runtime.sampling.params import SamplingParams
from kiln.runtime.sampling.penalty_window import window_tokens
from kiln.runtime.sampling.sampler import FEW_ROWS, Sampler

VOCAB = 1000


def _metadata(sampler: Sampler, requests: list[Request]):
    return sampler.send(sampler.columns(requests, VOCAB))


def _row(i: int) -> Request:
    """Row i: sampled (unseeded, seeded) or greedy, some with penalties (windows of 4,
    with a carried tail, or the whole reply) and some with a logit_bias or min_tokens."""
    kind = i % 5
    sampling = SamplingParams(
        temperature=0.0 if kind == 2 else 0.7, top_k=40 * (i % 3), top_p=0.9,
        seed=1000 + i if kind == 1 else None, repetition_penalty=1.1 if i % 2 else 1.0,
        repeat_last_n=(4, -1, 64)[i % 3])
    options = RequestOptions(logit_bias=((i, 2.0), (i + 7, -1.0)) if kind == 3 else (),
                             min_tokens=50 if kind == 4 else 0, logprobs=i % 4 or None)
    req = Request(f"r{i}", [1, 2, 3], sampling, max_tokens=100, options=options,
                  stop_token_ids=frozenset({0, 9}))
    for t in range(i % 7 + 1):
        req.append_output_token(100 + 3 * i + t)
    req.window_prefix = [500 + i, 501 + i] if i % 4 == 1 else []
    return req


@pytest.mark.parametrize("n", [5, FEW_ROWS + 12])
def test_columns_are_built_row_by_row(n):
    requests = [_row(i) for i in range(n)]
    md = _metadata(Sampler(torch.device("cpu"), use_triton=False, seed=7), requests)
    server = np.random.default_rng(7)
    seeds = [r.sampling.seed if r.sampling.seed is not None else
             0 if r.sampling.is_greedy else int(server.integers(0, 2**63 - 1))
             for r in requests]
    assert md.seeds.tolist() == seeds
    assert md.offsets.tolist() == [r.num_output_tokens if r.sampling.seed is not None else 0
                                   for r in requests]
    assert md.temperature.tolist() == pytest.approx([r.sampling.temperature for r in requests])
    assert md.top_k.tolist() == [r.sampling.top_k for r in requests]
    assert md.repetition_penalty.tolist() == pytest.approx(
        [r.sampling.repetition_penalty for r in requests])
    windows = [window_tokens(r.sampling.repeat_last_n, r.window_token_ids, r.window_prefix)
               if r.sampling.has_penalties else [] for r in requests]
    assert [[t for t in row if t >= 0] for row in md.window_token_ids.tolist()] == windows
    biases = [dict(r.options.logit_bias) | ({0: -np.inf, 9: -np.inf}
                                            if r.options.min_tokens else {})
              for r in requests]
    got = [{t: v for t, v in zip(ids, values) if t >= 0} for ids, values in
           zip(md.bias_token_ids.tolist(), md.bias_values.tolist())]
    assert got == biases
    assert md.num_top_logprobs == max(r.options.logprobs or 0 for r in requests)


def _same_columns(carried, fresh) -> None:
    """The same metadata, each row's penalty window as a multiset (the kernel counts it)."""
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty", "seeds", "offsets",
                 "bias_token_ids", "bias_values", "grammar_bitmask"):
        a, b = getattr(carried, name), getattr(fresh, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name
    assert (carried.num_top_logprobs, carried.flags) == (fresh.num_top_logprobs, fresh.flags)
    assert (carried.window_token_ids is None) == (fresh.window_token_ids is None)
    if fresh.window_token_ids is not None:
        assert [sorted(t for t in row if t >= 0) for row in carried.window_token_ids.tolist()] \
            == [sorted(t for t in row if t >= 0) for row in fresh.window_token_ids.tolist()]


def test_rows_carried_across_steps_give_what_a_fresh_build_gives():
    """Rows that stay, leave, come back, join and move between steps, one or two new window
    tokens a step (a 4-token ring wraps; a whole-reply window grows past the ring's first
    width): each step's columns are those built from the requests alone."""
    import copy

    rng = np.random.default_rng(3)
    pool = [_row(i) for i in range(40)]
    carried = Sampler(torch.device("cpu"), use_triton=False, seed=7)
    batch = pool[:20]
    for step in range(30):
        fresh = Sampler(torch.device("cpu"), use_triton=False)
        fresh.server_rng = copy.deepcopy(carried.server_rng)
        _same_columns(_metadata(carried, batch), _metadata(fresh, batch))
        for r in batch:
            for _ in range(1 + (step % 3 == 0 and r.request_id.endswith("1"))):
                r.append_output_token(int(rng.integers(0, VOCAB)))
        out = [r for r in batch if rng.random() > 0.1]  # some leave
        joining = [r for r in pool if r not in batch and rng.random() < 0.2]
        batch = out + joining
        if step % 7 == 3:
            rng.shuffle(batch)
    assert carried.rows.window.shape[1] >= 16  # the whole-reply windows grew


def test_carried_rows_sample_the_same_tokens():
    """Through the CPU sampler: the same tokens and logprobs from carried and fresh rows."""
    pool = [_row(i) for i in range(24)]
    carried = Sampler(torch.device("cpu"), use_triton=False, seed=11)
    logits = torch.randn(len(pool), VOCAB, generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        fresh = Sampler(torch.device("cpu"), use_triton=False)
        fresh.server_rng = __import__("copy").deepcopy(carried.server_rng)
        a, b = (s.run(logits, s.columns(pool, VOCAB)) for s in (carried, fresh))
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)
        for r, t in zip(pool, a.token_ids.tolist()):
            r.append_output_token(t)
