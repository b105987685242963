"""What one `kiln bench` run does, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.bench.prompts import PROMPT_SETS


@dataclass(frozen=True)
class BenchConfig:
    base_url: str  # ends in /v1
    label: str  # the server's name in results, tables and charts
    model: str  # sent as each request's model
    prompt_sets: tuple[str, ...]
    concurrency: tuple[int, ...]
    num_requests: int  # per level; 0 = max(8, 2 * concurrency)
    max_tokens: int
    long_tokens: int  # words (about tokens) of a long text
    warmup: int  # unmeasured requests per prompt set
    seed: int
    timeout: float  # seconds per request
    ignore_eos: bool = True  # send it where the server takes it: every reply max_tokens long

    def __post_init__(self) -> None:
        if bad := [s for s in self.prompt_sets if s not in PROMPT_SETS]:
            raise ValueError(f"unknown prompt set {bad}; choose from {', '.join(PROMPT_SETS)}")
        if not self.prompt_sets:
            raise ValueError("--prompts names no prompt set")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be positive integers")
        if self.max_tokens < 1 or self.long_tokens < 1:
            raise ValueError("--max-tokens and --long-tokens must be at least 1")
        if self.num_requests < 0 or self.warmup < 0:
            raise ValueError("--requests and --warmup must not be negative")
        if self.timeout <= 0:
            raise ValueError("--timeout must be positive")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url {self.base_url!r} is not an http(s) URL")

    def requests_at(self, concurrency: int) -> int:
        return self.num_requests or max(8, 2 * concurrency)
