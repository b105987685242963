"""A step's host arrays reach the device in one copy: packed (aligned, any dtype and shape)
and unpacked bit for bit; the runner and the sampler each send once per step."""

import numpy as np
import torch
from conftest import make_request

from kiln.runtime.engine.staging import ALIGN, StagingBuffer, StaticInputs


def test_mixed_arrays_round_trip_in_one_copy():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-5, 5, 7).astype(np.int64), rng.random(3, dtype=np.float32),
              rng.integers(0, 9, (4, 5)).astype(np.int32), np.zeros(0, dtype=np.int64),
              np.array([1.5], dtype=np.float32)]
    staging = StagingBuffer("cpu", capacity=64, copy=True)  # grows past 64 bytes
    for _ in range(2):  # the second send reuses the buffer
        sent = staging.send(*arrays)
        for a, t in zip(arrays, sent, strict=True):
            assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
            assert torch.equal(t, torch.from_numpy(a))
            assert t.data_ptr() % ALIGN == 0 and t.is_contiguous()
    assert staging.num_copies == 2


def test_a_step_sends_once_from_the_runner_and_once_from_the_sampler(make_engine):
    """Through packed copies (as on CUDA) the engine makes the same tokens as without."""
    from conftest import run_to_completion

    from kiln.runtime.sampling.params import SamplingParams

    def run(staged: bool):
        engine = make_engine(kv_cache_tokens=4096, max_num_seqs=4)
        if staged:
            engine.runner.staging = StagingBuffer("cpu", copy=True)
            engine.sampler.staging = StagingBuffer("cpu", copy=True)
        params = SamplingParams(temperature=0.8, seed=7, repetition_penalty=1.3)
        reqs = [make_request(engine, f"r{i}", [1, 2, 3, 4 + i], params, max_tokens=6,
                             logprobs=2) for i in range(3)]
        steps = 0

        def step():
            nonlocal steps
            steps += 1
            return original()
        original, engine.step = engine.step, step
        return engine, run_to_completion(engine, reqs), steps

    engine, staged, steps = run(True)
    assert engine.runner.staging.num_copies == steps
    assert engine.sampler.staging.num_copies == steps  # every step here samples
    assert staged == run(False)[1]


def test_static_inputs_send_a_prefix_of_their_layout_to_fixed_addresses():
    """The graphs' inputs: each field at its own fixed address; a send copies the host layout
    up to the given bytes of the last field named, the rest of the device copy stays."""
    inputs = StaticInputs("cpu", [("ids", torch.int64, (4,)), ("tables", torch.int32, (3, 2))])
    ids, tables = inputs.tensors["ids"], inputs.tensors["tables"]
    addresses = (ids.data_ptr(), tables.data_ptr())
    host = inputs.host()
    host["ids"][:] = [1, 2, 3, 4]
    host["tables"][:] = [[5, 6], [7, 8], [9, 10]]
    inputs.send("tables", tables[:2].nbytes)
    assert ids.tolist() == [1, 2, 3, 4] and tables.tolist() == [[5, 6], [7, 8], [0, 0]]
    assert (ids.data_ptr(), tables.data_ptr()) == addresses
    assert ids.data_ptr() % 16 == 0 and tables.data_ptr() % 16 == 0


def test_sampler_inputs_stage_columns_idle_padding_rows_and_windows():
    """The decode graphs' sampler inputs: the step's rows get their columns, the bucket's
    rows after them sample nothing (greedy, filters and penalties off), whatever an earlier,
    larger step left there; windows narrower than the buffer are -1 padded, and a step
    without windows sends the columns alone."""
    from kiln.runtime.engine.staging import SAMPLER_FIELDS, SamplerInputs

    inputs = SamplerInputs("cpu", 4, 8)
    names = [name for name, _, _ in SAMPLER_FIELDS]

    def stage(n: int, value: float, window=None):
        columns = [np.full(n, value, dtype=torch.empty(0, dtype=dt).numpy().dtype)
                   for _, dt, _ in SAMPLER_FIELDS]
        inputs.stage(columns, 4, window)
        return {name: inputs.tensors[name].tolist() for name in names}

    assert all(v == [2] * 4 for v in stage(4, 2, np.full((4, 8), 7)).values())
    got = stage(3, 3, np.array([[1, 2], [3, -1], [4, 5]]))
    for name, _, idle in SAMPLER_FIELDS:
        assert got[name] == [3, 3, 3, idle], name
    assert inputs.window.tolist() == [[1, 2] + [-1] * 6, [3] + [-1] * 7, [4, 5] + [-1] * 6,
                                      [-1] * 8]
    stage(2, 1)  # no windows: the device's stay as they were
    assert inputs.window[0].tolist() == [1, 2] + [-1] * 6
