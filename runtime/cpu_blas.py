"""Who does the CPU's matrix products, numpy's OpenBLAS or torch's MKL, with the thread pools
that go with each. Only one pool may spin at a time: both on every core took 250 ms a decode
step instead of 35 on the development machine.

Which is faster depends on the machine and the batch. OpenBLAS was twice as fast as MKL on an
AMD EPYC (shared/perf-notes.md). On an Intel Xeon with AVX-512 they are even at one row and
MKL is up to 1.5x faster at 4 to 64 rows; but with MKL's team on both cores a lone stream
served through `kiln serve` fell from 27 to 17 tokens/s (the server's thread and the client
preempt it every token), so a lone sequence stays on OpenBLAS, and so do its prefill
chunks up to a few hundred rows: switching to MKL and back for them cost 35-70 ms at 12-40
rows, broke even at 256 and slowed the next token by about 10 ms. A chunk of 1,024 rows is
worth the switch (a 2,000-token prompt served cold took 3.2 s instead of 4.5 s), and so is a
short chunk behind a long cached prefix, whose attention then runs on two threads (the
last 30 tokens of a 2,046-token prompt: 0.13 s instead of 0.19 s to the first token). `choose`
measures the model's own products at 4 and 16 rows once at start-up; the runner calls
`for_batch` before each forward. `--deterministic` always uses OpenBLAS, whose padded gemm
it relies on (runtime/cpu_attention.py). The choice is process-wide, as the thread pools
are.

A model whose products read the GGUF's blocks (runtime/quant_linear.py) does a step of up
to `quant_linear.MAX_ROWS` rows in that kernel's own OpenMP team: the "blocks" pool, with
OpenBLAS and torch on one thread each so that nothing else spins beside it (a lone decode
step took 13.4 ms so against 17.0 ms with OpenBLAS's second thread left spinning). Bigger
steps go to the policy's library as before.

A model loaded with `--dtype bfloat16` does its products in oneDNN (runtime/packed_linear.py),
on torch's pool: the "bf16" policy. Alone (no server) one row's products took 27 ms on one
thread against 15 ms on two, but served, a lone stream's decode on both cores took 66-69 ms a
token against 48-52 ms on one (the server and its client preempt the team), so a decode
step of one sequence runs on one thread; anything with more rows (a batch, a prefill chunk)
runs on every core.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import torch
from threadpoolctl import ThreadpoolController

log = logging.getLogger("kiln")

# mkl: MKL for batches of more than one sequence, and for a lone sequence's prefill chunks of
# MKL_PREFILL_ROWS rows or more, or reading MKL_PREFILL_CONTEXT tokens or more (its attention
# then runs on torch's threads too); bf16: oneDNN's packed bf16 for all of them
MKL_PREFILL_ROWS = 512
MKL_PREFILL_CONTEXT = 1024
POLICIES = ("openblas", "mkl", "bf16")
_policy = "openblas"
# the pool that spins: "openblas" (numpy's), "torch" (MKL and oneDNN) or "blocks" (neither:
# runtime/csrc/quant_matmul.c's team)
_current = "openblas"
_block_rows = 0  # steps of up to this many rows use the block products (0: the model has none)
_measured: str | None = None
_blas = None  # threadpoolctl's handles on the loaded BLAS libraries, found once


def _use(pool: str) -> None:
    global _current, _blas
    if _blas is None:
        _blas = ThreadpoolController().select(user_api="blas").lib_controllers
    n = os.cpu_count() or 1
    for lib in _blas:  # a direct call into the library: about a microsecond
        lib.set_num_threads(n if pool == "openblas" else 1)
    torch.set_num_threads(n if pool == "torch" else 1)
    _current = pool


def set_policy(policy: str) -> None:
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"unknown CPU BLAS {policy!r}: one of {', '.join(POLICIES)}")
    _policy = policy
    _use("torch" if policy == "bf16" else "openblas")


def policy() -> str:
    return _policy


def for_batch(num_seqs: int, num_tokens: int, max_seq_len: int = 0) -> None:
    """Give the next forward (num_seqs sequences, num_tokens rows, the longest reading
    max_seq_len tokens of context) to the library the policy names."""
    long_prefill = num_tokens >= MKL_PREFILL_ROWS or \
        (num_tokens > 1 and max_seq_len >= MKL_PREFILL_CONTEXT)
    torch_pool = (_policy == "mkl" and (num_seqs > 1 or long_prefill)) \
        or (_policy == "bf16" and num_tokens > 1)
    if num_tokens <= _block_rows:
        pool = "blocks"
    else:
        pool = "torch" if torch_pool else "openblas"
    if pool != _current:
        _use(pool)


def matmul(x: np.ndarray, weight_t: np.ndarray) -> np.ndarray:
    """x: [T, in] @ weight_t: [in, out] with the library in use (no copies either way)."""
    if _current == "torch":
        return torch.matmul(torch.from_numpy(x), torch.from_numpy(weight_t)).numpy()
    return np.matmul(x, weight_t)


def _time(weights_t: list[np.ndarray], rows: tuple[int, ...], repeats: int) -> float:
    total = 0.0
    for m in rows:
        xs = {w.shape[0]: np.ones((m, w.shape[0]), dtype=np.float32) for w in weights_t}
        for w in weights_t:  # warm the pool and the caches
            matmul(xs[w.shape[0]], w)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for w in weights_t:
                matmul(xs[w.shape[0]], w)
            best = min(best, time.perf_counter() - t0)
        total += best
    return total


def choose(weights_t: list[np.ndarray], rows: tuple[int, ...] = (4, 16),
           repeats: int = 3) -> str:
    """Time both libraries on the model's products ([in, out] views, one layer's worth) at a
    few batch sizes, on a thread of its own (no OpenMP team is left on the caller's), and
    set the policy: MKL for batches if it was faster."""
    totals: dict[str, float] = {}

    def measure() -> None:
        # Alternate, with a pause, so neither is timed while the other's threads still spin.
        for _ in range(2):
            for backend, pool in (("openblas", "openblas"), ("mkl", "torch")):
                _use(pool)
                time.sleep(0.05)
                t = _time(weights_t, rows, repeats)
                totals[backend] = min(totals.get(backend, t), t)

    worker = threading.Thread(target=measure, name="kiln-cpu-blas")
    worker.start()
    worker.join()
    chosen = min(totals, key=totals.get)
    set_policy(chosen)
    log.info("[kiln]  CPU matrix products: OpenBLAS for one sequence, %s for batches (one layer "
             "at %s rows: %s)", "MKL" if chosen == "mkl" else "OpenBLAS",
             "/".join(map(str, rows)),
             ", ".join(f"{b} {t * 1e3:.2f} ms" for b, t in totals.items()))
    return chosen


def configure(model, setting: str = "auto", deterministic: bool = False) -> str:
    """Apply `--cpu-blas` for a model loaded on the CPU. "auto" measures once per process,
    on the model's first layer; a later model (a switch while serving) keeps that choice
    rather than timing products while another engine still runs. A model with packed bf16
    weights has its products done by oneDNN whatever the setting."""
    global _measured, _block_rows
    _block_rows = 0 if deterministic else getattr(model, "block_rows", 0)
    if getattr(model, "cpu_bf16", False):
        if deterministic:  # the CLI refuses this pair first; a caller of the runtime may not
            raise ValueError("--deterministic needs --dtype float32")
        chosen = "bf16"
        log.info("[kiln]  CPU matrix products: bf16 weights packed for oneDNN; one thread for "
                 "a lone sequence's decode, every core otherwise")
    elif deterministic:
        chosen = "openblas"
    elif setting != "auto":
        chosen = setting
    elif _measured is None:
        weights_t = [t.numpy().T for t in model.layers[0].values()
                     if isinstance(t, torch.Tensor) and t.dim() == 2]
        _measured = chosen = choose(weights_t)
    else:
        chosen = _measured
    set_policy(chosen)
    return chosen
