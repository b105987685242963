"""What a run measured: each request's timings, and each level's summary of them.

Per request: TTFT (to the first non-empty content chunk), TPOT = (e2e - TTFT) / (n_out - 1)
and the inter-token latencies (ITL) between content chunks. Output tokens come from `usage`
when the server sends it (`stream_options.include_usage`), else from the content chunks' count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    ttft: float = 0.0  # seconds to the first non-empty content chunk
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    content_chunks: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    def row(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "itl"} | {"tpot": self.tpot}


@dataclass
class Summary:
    mean: float
    p50: float
    p99: float


@dataclass
class LevelResult:
    prompt_set: str
    concurrency: int
    num_requests: int
    errors: int
    wall_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s over the level's wall time
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tps: float  # sum(prompt_tokens) / sum(ttft): prompt tokens per second of TTFT
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    requests: list[dict]  # per request: ttft, e2e, tpot, tokens, finish_reason, error


def summarize(xs: list[float]) -> Summary:
    """Mean, p50 and p99 (linear interpolation between ranks, as numpy); zeros for no data."""
    s = sorted(xs) or [0.0]

    def pct(q: float) -> float:
        k = (len(s) - 1) * q / 100
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return Summary(sum(s) / len(s), pct(50), pct(99))


def level_result(kind: str, concurrency: int, results: list[RequestResult], wall: float
                 ) -> LevelResult:
    ok = [r for r in results if r.error is None]
    out, prompt = sum(r.output_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    ttft_sum = sum(r.ttft for r in ok)
    return LevelResult(
        prompt_set=kind, concurrency=concurrency, num_requests=len(results),
        errors=len(results) - len(ok), wall_s=wall, request_throughput=len(ok) / wall,
        output_throughput=out / wall, output_tokens=out, prompt_tokens=prompt,
        cached_tokens=sum(r.cached_tokens for r in ok),
        prefill_tps=prompt / ttft_sum if ttft_sum > 0 else 0.0,
        ttft=summarize([r.ttft for r in ok]),
        tpot=summarize([r.tpot for r in ok if r.tpot is not None]),
        itl=summarize([x for r in ok for x in r.itl]), e2e=summarize([r.e2e for r in ok]),
        requests=[r.row() for r in results])
