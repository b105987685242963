"""OpenAI response bodies and stream chunks: ids, usage with kiln's timings, logprobs."""

from __future__ import annotations

import secrets
import time

from kiln.api.generation import Totals


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def system_fingerprint() -> str:
    # Each stream gets a random one; non-streaming responses have none (contract.md).
    return f"fp_{secrets.token_hex(5)}"


def usage(t: Totals, ctx_len: int) -> dict:
    total = t.prompt_tokens + t.completion_tokens
    end = t.finish_time or time.monotonic()
    first = t.first_token_time or end
    ttft = max(first - t.arrival_time, 0.0)
    decoding = max(end - first, 0.0)
    new_prompt = t.prompt_tokens - t.cached_tokens
    return {
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": t.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": t.reasoning_tokens},
        "kv_token_occupancy_rate_percentage": round(100.0 * total / ctx_len, 2),
        "prefill_duration_ttft": round(ttft, 4),
        "decoding_duration": round(decoding, 4),
        "prefill_speed_tps": round(new_prompt / ttft, 2) if ttft > 0 else 0.0,
        "decoding_speed_tps": round((t.completion_tokens - 1) / decoding, 2)
        if decoding > 0 and t.completion_tokens > 1 else 0.0,
    }


def completion_logprobs(entries: list[dict], text_offset: int) -> dict:
    """/v1/completions' legacy logprobs shape from chat-style entries (an echoed prompt's
    first token has logprob and top_logprobs None: nothing precedes it)."""
    tokens, offsets, offset = [], [], text_offset
    for e in entries:
        tokens.append(e["token"])
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                         if e["top_logprobs"] is not None else None for e in entries],
        "text_offset": offsets,
    }
