"""runtime/cpu_attention.py (the CPU server's attention) against the torch reference in
kernels/attention.py, and its batch invariance in deterministic mode."""

import numpy as np
import pytest
import torch

from kernels.attention import paged_attention_ref
from runtime.cpu_attention import MAX_RUNS, CpuAttentionPlan, paged_attention_cpu

NB, BS, KVH, D, H = 200, 16, 3, 64, 9


def _batch(seqs, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(NB, BS, KVH, D, generator=g)
    vc = torch.randn(NB, BS, KVH, D, generator=g)
    perm = torch.randperm(NB, generator=g).int()  # scrambled physical blocks
    tables = torch.zeros(len(seqs), 40, dtype=torch.int32)
    off = 0
    for i, (L, _) in enumerate(seqs):
        nb = -(-L // BS)
        tables[i, :nb] = perm[off:off + nb]
        off += nb
    qsl = torch.tensor([0, *np.cumsum([ql for _, ql in seqs])], dtype=torch.int32)
    sl = torch.tensor([L for L, _ in seqs], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), H, D, generator=g)
    return q, kc, vc, tables, sl, qsl


# (seq_len, query_len): a prefill chunk after cached context, decodes, a whole prompt.
MIXED = [(337, 37), (129, 1), (17, 1), (50, 50), (1, 1), (256, 1)]


@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("deterministic", [False, True])
def test_matches_the_reference_on_a_mixed_batch(window, deterministic):
    q, kc, vc, tables, sl, qsl = _batch(MIXED)
    ref = paged_attention_ref(q, kc, vc, tables, sl, qsl, 0.125, sliding_window=window)
    got = paged_attention_cpu(q, kc, vc, tables, sl, qsl, 0.125, sliding_window=window,
                              deterministic=deterministic)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


def _one(q_rows, kc, vc, table, seq_len):
    return paged_attention_cpu(
        q_rows, kc, vc, table[None], torch.tensor([seq_len], dtype=torch.int32),
        torch.tensor([0, q_rows.shape[0]], dtype=torch.int32), 0.125, deterministic=True)


def test_deterministic_rows_do_not_depend_on_chunking_or_neighbours():
    q, kc, vc, tables, sl, qsl = _batch(MIXED)
    full = paged_attention_cpu(q, kc, vc, tables, sl, qsl, 0.125, deterministic=True)
    # Sequence 0's chunk (positions 300..336) read as a decode of its last row, a decode of
    # a middle row, and a shorter chunk.
    assert torch.equal(_one(q[36:37], kc, vc, tables[0], 337)[0], full[36])
    assert torch.equal(_one(q[10:11], kc, vc, tables[0], 311)[0], full[10])
    assert torch.equal(_one(q[20:37], kc, vc, tables[0], 337), full[20:37])
    # A decode row alone equals the same row beside the others.
    assert torch.equal(_one(q[37:38], kc, vc, tables[1], 129)[0], full[37])


@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("layout", ["one run", "cached prefix", "scrambled"])
@pytest.mark.parametrize("seq_len", [1, 16, 17, 337])
def test_a_lone_decode_matches_the_reference(seq_len, layout, window):
    # One stream's decode reads its keys in place, run by run of consecutive blocks (one
    # run; a cached prefix then its own blocks), and through a gather when its blocks are
    # scattered: each must agree with the reference.
    g = torch.Generator().manual_seed(seq_len)
    kc, vc = torch.randn(NB, BS, KVH, D, generator=g), torch.randn(NB, BS, KVH, D, generator=g)
    nb = -(-seq_len // BS)
    blocks = {"one run": torch.arange(5, 5 + nb),
              "cached prefix": torch.cat([torch.arange(0, 2), torch.arange(50, 50 + nb)])[:nb],
              "scrambled": torch.randperm(NB, generator=g)[:nb]}[layout]
    table = torch.zeros(1, 40, dtype=torch.int32)
    table[0, :nb] = blocks
    plan = CpuAttentionPlan.build(table, torch.tensor([seq_len], dtype=torch.int32),
                                  torch.tensor([0, 1], dtype=torch.int32), BS, False)
    num_runs = {"one run": 1, "cached prefix": min(nb, 2) if nb > 2 else 1,
                "scrambled": None}[layout]
    if num_runs is None:
        assert plan.decode_runs is None or nb <= MAX_RUNS
    else:
        assert len(plan.decode_runs) == num_runs
    q = torch.randn(1, H, D, generator=g)
    args = (q, kc, vc, table, torch.tensor([seq_len], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 0.125)
    ref = paged_attention_ref(*args, sliding_window=window)
    got = paged_attention_cpu(*args, sliding_window=window, plan=plan)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
