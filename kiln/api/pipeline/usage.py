"""What a reply reports of its cost: OpenAI's usage block with kiln's timings, and the
Responses API's names for the same numbers."""

from __future__ import annotations

import time

from kiln.api.pipeline.assembler import Totals


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
        "completion_tokens_details": {
            "reasoning_tokens": t.reasoning_tokens,
            "accepted_prediction_tokens": t.accepted_prediction_tokens,
            "rejected_prediction_tokens": t.rejected_prediction_tokens},
        "kv_token_occupancy_rate_percentage": round(100.0 * total / ctx_len, 2),
        "prefill_duration_ttft": round(ttft, 4),
        "decoding_duration": round(decoding, 4),
        "prefill_speed_tps": round(new_prompt / ttft, 2) if ttft > 0 else 0.0,
        "decoding_speed_tps": round((t.completion_tokens - 1) / decoding, 2)
        if decoding > 0 and t.completion_tokens > 1 else 0.0,
    }


def responses_usage(chat_usage: dict) -> dict:
    """The chat route's usage in the Responses API's names; kiln's own timing fields ride
    along, as on the chat route."""
    u = dict(chat_usage)
    out = {
        "input_tokens": u.pop("prompt_tokens"),
        "input_tokens_details": {"cached_tokens": u.pop("prompt_tokens_details")
                                 ["cached_tokens"], "cache_write_tokens": 0},
        "output_tokens": u.pop("completion_tokens"),
        "output_tokens_details": {"reasoning_tokens": u.pop("completion_tokens_details")
                                  ["reasoning_tokens"]},
        "total_tokens": u.pop("total_tokens"),
    }
    return out | u
