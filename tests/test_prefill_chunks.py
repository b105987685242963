"""Prefill chunk arithmetic and its log lines, on the scheduler alone (no model)."""

import logging

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.request import Request
from kiln.runtime.engine.scheduler import Scheduler, prefill_chunk_plan
from kiln.runtime.kv.kv_cache_manager import KVCacheManager
from kiln.runtime.sampling.params import SamplingParams


def _run_prefill(sched: Scheduler, req: Request) -> list[int]:
    sched.add_request(req)
    sizes = []
    while req.num_computed_tokens < req.num_tokens:
        out = sched.schedule()
        sizes += [n for r, n in out.scheduled if r is req]
        sched.update_after_step(out.scheduled)
    return sizes


def _scheduler(ctx=65536, chunk=4096):
    cfg = EngineConfig.build(65536, 1024, ctx_len=ctx, prefill_chunk_len=chunk,
                             kv_cache_tokens=70000)
    return Scheduler(cfg, KVCacheManager(cfg.num_blocks, cfg.block_size, "m"))


def test_32k_prompt_reads_as_seven_4096_chunks_and_one_of_3328(caplog):
    sched = _scheduler()
    req = Request("a", list(range(32000)), SamplingParams(), max_tokens=1)
    with caplog.at_level(logging.INFO, logger="kiln"):
        sizes = _run_prefill(sched, req)
    assert sizes == [4096] * 7 + [3328]
    lines = [r.getMessage() for r in caplog.records if "Prefill chunk" in r.getMessage()]
    assert lines == [f"[kiln]  Prefill chunk {i}/8 with 4096 tokens" for i in range(1, 8)] + \
        ["[kiln]  Prefill chunk 8/8 with 3328 tokens"]


def test_chunks_after_a_cache_hit_end_on_multiples_from_the_start(caplog):
    sched = _scheduler()
    first = Request("a", list(range(32000)), SamplingParams(), max_tokens=1)
    _run_prefill(sched, first)
    sched.finish(first, first.status)
    second = Request("b", list(range(5000)) + [7] * 27000, SamplingParams(), max_tokens=1)
    with caplog.at_level(logging.INFO, logger="kiln"):
        sizes = _run_prefill(sched, second)
    assert second.num_cached_tokens == 4992  # 312 full blocks of the shared 5,000 tokens
    ends = [4992 + sum(sizes[:i + 1]) for i in range(len(sizes))]
    assert ends == [8192, 12288, 16384, 20480, 24576, 28672, 32000]
    lines = [r.getMessage() for r in caplog.records if "Prefill chunk" in r.getMessage()]
    assert lines[0] == "[kiln]  Prefill chunk 1/7 with 3200 tokens"
    assert lines[-1] == "[kiln]  Prefill chunk 7/7 with 3328 tokens"


def test_chunk_plan_arithmetic():
    assert prefill_chunk_plan(0, 1024, 1024) == [1024]
    assert prefill_chunk_plan(0, 1025, 1024) == [1024, 1]
    assert prefill_chunk_plan(1000, 3000, 1024) == [24, 1024, 952]


def test_prefill_chunk_len_is_raised_and_rounded_up_to_a_power_of_two():
    assert EngineConfig.build(8192, 1024, prefill_chunk_len=5000).prefill_chunk_len == 8192
    assert EngineConfig.build(8192, 1024, prefill_chunk_len=100).prefill_chunk_len == 512
    assert EngineConfig.build(8192, 1024, prefill_chunk_len=1024).prefill_chunk_len == 1024
    assert EngineConfig.build(8192, 1024).prefill_chunk_len == 1024


def test_ctx_len_is_raised_to_512_and_capped_at_the_model():
    assert EngineConfig.build(8192, 1024, ctx_len=100).ctx_len == 512
    assert EngineConfig.build(8192, 1024, ctx_len=100000).ctx_len == 8192
    assert EngineConfig.build(8192, 1024).ctx_len == 8192


def _first_steps(max_num_batched_tokens: int, steps: int = 2) -> list[list[tuple[str, int]]]:
    """Three 1,500-token prompts with 512-token chunks: what each of the first steps reads."""
    cfg = EngineConfig.build(4096, 1024, prefill_chunk_len=512, kv_cache_tokens=8192,
                             max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens)
    sched = Scheduler(cfg, KVCacheManager(cfg.num_blocks, cfg.block_size, "m"))
    for rid in "abc":
        sched.add_request(Request(rid, [ord(rid)] * 1500, SamplingParams(), max_tokens=1))
    taken = []
    for _ in range(steps):
        out = sched.schedule()
        taken.append([(r.request_id, n) for r, n in out.scheduled])
        sched.update_after_step(out.scheduled)
    return taken


def test_a_larger_step_budget_reads_several_prompts_chunks_at_once():
    # The default (and any smaller value): a chunk beside a token for each running request.
    assert _first_steps(0) == _first_steps(100) == [[("a", 512)], [("a", 512)]]
    # vLLM's --max-num-batched-tokens: the chunks of several prompts in one step, each
    # prompt still read one chunk a step (the contract's chunks and their log lines).
    assert _first_steps(1100) == [[("a", 512), ("b", 512)], [("a", 512), ("b", 512)]]
    assert _first_steps(2048) == [[("a", 512), ("b", 512), ("c", 512)]] * 2
