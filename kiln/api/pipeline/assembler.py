"""From engine outputs to what a response says: text deltas (never a split UTF-8
character), stop strings cut out, reasoning split off, logprobs in OpenAI's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.engine.request import RequestOutput, TokenLogprob
from kiln.runtime.text.detokenizer import IncrementalDetokenizer
from kiln.runtime.text.reasoning import ReasoningParser, ReasoningStart
from kiln.runtime.text.tokenizer import Tokenizer
from kiln.runtime.text.tool_parser import ToolCallDelta, ToolCallParser


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    # The first delta of a request that asked for its prompt's logprobs: an entry per
    # prompt token (the first None), in the logprobs style's shape.
    prompt_logprobs: list[dict | None] | None = None


@dataclass
class Totals:
    """What the usage block needs, kept as outputs arrive."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0  # drafted tokens kept (speculative decoding)
    rejected_prediction_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None


def combined_totals(totals: list[Totals], n: int = 1) -> Totals:
    """One usage for a request's choices, n per prompt (choice p * n + i): each prompt once
    (its choices share it), every choice's completion tokens, timings from the first
    arrival to the last finish."""
    prompts = totals[::n]
    times = [t.first_token_time for t in totals if t.first_token_time is not None]
    ends = [t.finish_time for t in totals if t.finish_time is not None]
    return Totals(
        prompt_tokens=sum(t.prompt_tokens for t in prompts),
        cached_tokens=sum(t.cached_tokens for t in prompts),
        completion_tokens=sum(t.completion_tokens for t in totals),
        reasoning_tokens=sum(t.reasoning_tokens for t in totals),
        accepted_prediction_tokens=sum(t.accepted_prediction_tokens for t in totals),
        rejected_prediction_tokens=sum(t.rejected_prediction_tokens for t in totals),
        arrival_time=min(t.arrival_time for t in totals),
        first_token_time=min(times) if times else None,
        finish_time=max(ends) if len(ends) == len(totals) else None)


class OutputAssembler:
    def __init__(self, tokenizer: Tokenizer, *, stop: list[str] = (),
                 reasoning_tags: tuple[str, str] | None = None,
                 reasoning_start: ReasoningStart = ReasoningStart.OUTSIDE,
                 hold_trailing_space: bool = False, logprobs_style: str | None = None,
                 tool_parser: ToolCallParser | None = None):
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self.stop = [s for s in stop if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.reasoning = ReasoningParser(reasoning_tags, reasoning_start) \
            if reasoning_tags else None
        self.hold_trailing_space = hold_trailing_space
        self.logprobs_style = logprobs_style  # None, "chat" or "completions"
        self.tool_parser = tool_parser  # calls out of the content
        self.called = False
        self.pending = ""  # text held back: it may be the start of a stop string
        self.held_space = ""
        self.stopped = False  # a stop string was found: the engine request must be aborted
        self.totals = Totals()
        self.text = ""  # the whole raw reply so far, as emitted (completions' echo, tests)

    def add(self, out: RequestOutput, now: float) -> Delta:
        t = self.totals
        t.prompt_tokens, t.cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        t.completion_tokens = out.num_output_tokens
        t.accepted_prediction_tokens = out.num_accepted_tokens
        t.rejected_prediction_tokens = out.num_rejected_tokens
        t.arrival_time, t.first_token_time = out.arrival_time, out.first_token_time
        text = "".join(self.detok.feed(tok) for tok in out.new_token_ids
                       if not (out.finished and out.finish_reason == "stop"
                               and tok in self.tokenizer.stop_token_ids))
        delta = Delta()
        if self.logprobs_style and out.new_logprobs:
            delta.logprobs = [self._logprob_entry(lp) for lp in out.new_logprobs]
        if self.logprobs_style and out.prompt_logprobs is not None:
            delta.prompt_logprobs = [lp and self._logprob_entry(lp)
                                     for lp in out.prompt_logprobs]
        finished = out.finished
        if finished:
            text += self.detok.finish()
            t.finish_time = now
        raw = self._cut_stop(self.pending + text, final=finished)
        if self.stopped:
            finished = True
            delta.finish_reason = "stop"
            t.finish_time = now
        elif finished:
            delta.finish_reason = out.finish_reason
        self.text += raw
        self._split(raw, delta, finished)
        if self.tool_parser is not None:
            parsed = self.tool_parser.feed(delta.content)
            if finished:
                tail = self.tool_parser.finish()
                parsed.content += tail.content
                parsed.tool_calls += tail.tool_calls
            delta.content, delta.tool_calls = parsed.content, parsed.tool_calls
            self.called |= bool(parsed.tool_calls)
            if finished and self.called and delta.finish_reason == "stop":
                delta.finish_reason = "tool_calls"
        if delta.reasoning and not delta.content:
            t.reasoning_tokens += len(out.new_token_ids)
        return delta

    def _cut_stop(self, text: str, final: bool) -> str:
        """Text safe to emit now; a found stop string and everything after it is dropped."""
        if not self.stop:
            return text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.pending = ""
            return text[:cut]
        if final:
            self.pending = ""
            return text
        keep = self.max_stop - 1
        safe = len(text) - keep if keep else len(text)
        # Hold back only a tail that could still grow into a stop string.
        while safe < len(text) and not any(s.startswith(text[safe:]) for s in self.stop):
            safe += 1
        safe = max(safe, 0)
        self.pending = text[safe:]
        return text[:safe]

    def _split(self, raw: str, delta: Delta, finished: bool) -> None:
        if self.reasoning is not None:
            r = self.reasoning.feed(raw)
            reasoning, content = r.reasoning, r.content
            if finished:
                f = self.reasoning.finish()
                reasoning, content = reasoning + f.reasoning, content + f.content
        else:
            reasoning, content = "", raw
        if self.hold_trailing_space:
            content = self.held_space + content
            stripped = content if finished else content.rstrip()
            self.held_space = content[len(stripped):]
            content = stripped
        delta.reasoning, delta.content = reasoning, content

    def _logprob_entry(self, lp: TokenLogprob) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            return {"token": self.detok.token_text(token_id), "logprob": logprob,
                    "bytes": self.detok.token_bytes(token_id)}

        entry = item(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [item(i, v) for i, v in lp.top]
        return entry
