"""The one interface the API holds an engine by (runtime/engine/client.py): both engines have
every member with the same parameters, and the local one streams an EngineRequest as the
synchronous engine runs it, refusing a bad one before any output."""

import asyncio
import inspect

import pytest
from conftest import run_to_completion

from kiln.runtime.engine.async_engine import AsyncEngine
from kiln.runtime.engine.client import EngineClient
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions
from kiln.runtime.errors import ContextLengthError, InvalidRequestError
from kiln.runtime.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
MEMBERS = [name for name in vars(EngineClient)
           if not name.startswith("_") and name not in ("abc", "config")]


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("member", MEMBERS)
def test_both_engines_have_every_member_with_its_parameters(member):
    pytest.importorskip("ray.serve", reason="the `cluster` extra is not installed")
    from kiln.cluster.engine import ClusterEngine

    want = _parameters(getattr(EngineClient, member))
    for engine in (AsyncEngine, ClusterEngine):
        impl = getattr(engine, member)
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(
            getattr(EngineClient, member)), (engine.__name__, member)
        assert _parameters(impl) == want, (engine.__name__, member)


def test_the_local_engine_streams_what_the_engine_generates(make_engine):
    prompt = tuple(range(1000, 1040))
    request = EngineRequest(prompt, GREEDY, RequestOptions(max_tokens=6, logprobs=1))
    engine = make_engine()
    want = run_to_completion(engine, [engine.make_request("a", request)])["a"]

    async def stream() -> list:
        client = AsyncEngine(make_engine())
        try:
            assert isinstance(client, EngineClient)
            outputs = [out async for out in await client.add_request("b", request)]
            return outputs, client.stats()
        finally:
            client.shutdown()

    outputs, stats = asyncio.run(stream())
    assert [t for out in outputs for t in out.new_token_ids] == want
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert all(len(out.new_logprobs) == len(out.new_token_ids) for out in outputs)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_free_blocks == stats.kv_total_blocks


@pytest.mark.parametrize("options, error", [
    (RequestOptions(max_tokens=10_000), ContextLengthError),
    (RequestOptions(logit_bias=((10**6, 1.0),)), InvalidRequestError),
    (RequestOptions(stop_token_ids=frozenset({10**6}), min_tokens=2), InvalidRequestError),
], ids=["context", "logit-bias-id", "stop-token-id"])
def test_a_request_that_cannot_run_is_refused_before_any_output(make_engine, options, error):
    async def add():
        client = AsyncEngine(make_engine())
        try:
            with pytest.raises(error):
                await client.add_request("x", EngineRequest((1, 2, 3), GREEDY, options))
            return client.stats(), dict(client.streams)
        finally:
            client.shutdown()

    stats, streams = asyncio.run(add())
    assert streams == {} and stats.num_waiting == stats.num_running == 0


def test_engine_requests_check_their_own_invariants():
    with pytest.raises(ValueError):
        EngineRequest((), GREEDY)
    for bad in (dict(max_tokens=0), dict(min_tokens=-1), dict(logprobs=21), dict(stop=("",)),
                dict(logit_bias=((1, 1.0), (1, 2.0)))):
        with pytest.raises(ValueError):
            RequestOptions(**bad)
    assert RequestOptions(stop=["a"]).stop == ("a",)  # frozen: lists become tuples
