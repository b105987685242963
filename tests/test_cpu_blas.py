"""runtime/cpu_blas.py: both libraries give the products numpy gives, the thread pools follow
the library in use (only one of them spins), a lone sequence stays on OpenBLAS, and
`configure` applies the serve flag."""

import os

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info

from runtime import cpu_blas


def _blas_threads() -> int:
    return min(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")


@pytest.fixture(autouse=True)
def restore():
    yield
    cpu_blas.set_policy("openblas")
    torch.set_num_threads(1)  # as conftest leaves it


@pytest.mark.parametrize("policy", cpu_blas.POLICIES)
def test_each_library_computes_the_same_product(policy):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 96), dtype=np.float32)
    w = rng.standard_normal((64, 96), dtype=np.float32)  # [out, in], used transposed
    cpu_blas.set_policy(policy)
    cpu_blas.for_batch(4, 4)
    np.testing.assert_allclose(cpu_blas.matmul(x, w.T), x.astype(np.float64) @ w.T, rtol=1e-4,
                               atol=1e-4)


def test_a_batch_moves_to_mkl_and_a_lone_sequence_back_to_openblas():
    cores = os.cpu_count() or 1
    cpu_blas.set_policy("mkl")
    cpu_blas.for_batch(2, 2)
    assert cpu_blas._current == "torch"
    assert _blas_threads() == 1 and torch.get_num_threads() == cores
    cpu_blas.for_batch(1, 1)
    assert cpu_blas._current == "openblas"
    assert _blas_threads() == cores and torch.get_num_threads() == 1
    cpu_blas.set_policy("openblas")
    cpu_blas.for_batch(16, 16)
    assert cpu_blas._current == "openblas" and torch.get_num_threads() == 1


@pytest.mark.parametrize("num_tokens, max_seq_len, pool", [
    (1, 4000, "openblas"),  # a decode step, however long its context
    (40, 100, "openblas"),  # a short prompt: switching would cost more than MKL saves
    (300, 364, "openblas"),
    (1024, 1024, "torch"),  # a long prompt's chunk
    (30, 2046, "torch"),  # the end of a long cached prompt: its attention gets both cores
])
def test_a_lone_sequence_moves_to_mkl_only_for_long_prefills(num_tokens, max_seq_len, pool):
    cpu_blas.set_policy("mkl")
    cpu_blas.for_batch(1, num_tokens, max_seq_len)
    assert cpu_blas._current == pool


def test_choose_measures_and_sets_a_policy():
    rng = np.random.default_rng(1)
    weights_t = [rng.standard_normal((64, 128), dtype=np.float32).T for _ in range(3)]
    chosen = cpu_blas.choose(weights_t, rows=(4,), repeats=1)
    assert chosen in cpu_blas.POLICIES and cpu_blas.policy() == chosen


def test_deterministic_and_explicit_settings_win_over_auto(smollm2):
    assert cpu_blas.configure(smollm2.model, "auto", deterministic=True) == "openblas"
    assert cpu_blas.configure(smollm2.model, "mkl") == "mkl"
    assert cpu_blas.configure(smollm2.model, "openblas") == "openblas"
    with pytest.raises(ValueError):
        cpu_blas.set_policy("atlas")
