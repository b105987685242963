"""The prompt sets: the chat messages of request `index` of a set, the same for the same seed.

- `short`: one of 16 one-line questions.
- `long`: about `long_tokens` words, different from the first word on (prefill, cold).
- `shared-prefix`: one long text shared by every request, then a different question (prefill
  from a prefix cache).
- `prefixes`: request i reads long text i % NUM_PREFIXES (several users' documents).
- `editing`, `quoting`, `free`: speculative decoding's workloads (spec_prompts.py).
"""

from __future__ import annotations

import random

from kiln.bench.spec_prompts import SPEC_SETS, spec_prompt

PROMPT_SETS = ("short", "long", "shared-prefix", "prefixes", *SPEC_SETS)
NUM_PREFIXES = 4
SHORT_PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
    "Write a haiku about the sea.", "Explain what a CPU cache is in two sentences.",
    "Give me a synonym for 'happy'.", "How many legs does a spider have?",
    "What does HTTP stand for?", "Suggest a name for a grey cat.", "What is 17 times 3?",
    "List four fruits that are red.", "Translate 'good morning' into Spanish.",
    "Describe a rainy day in one sentence.", "What is the boiling point of water?",
    "Write a short greeting for a birthday card.", "Who wrote Romeo and Juliet?"]
# Common English words, one token each (with their leading space) in SmolLM2's vocabulary.
WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work number night
point home water room mother area money story fact month lot right study book eye job word issue
side kind head house service friend father power hour game line end member law car city name team
minute idea kid body back parent face level office door health person art war history party music
""".split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_prompt(kind: str, index: int, seed: int, long_tokens: int) -> list[dict]:
    """Request `index` of set `kind` (warm-ups use negative indices: never a measured prompt)."""
    if kind in SPEC_SETS:
        return spec_prompt(kind, index, seed)
    rng = random.Random(f"{seed}:{kind}:{index}")
    if kind == "short":
        order = random.Random(seed).sample(SHORT_PROMPTS, len(SHORT_PROMPTS))
        text = order[index % len(order)]
    elif kind == "long":  # different from its first word on, so no prefix is shared
        text = f"Text {index}: {_words(rng, long_tokens)}\n\nSummarize the text above."
    elif kind in ("shared-prefix", "prefixes"):
        which = index % NUM_PREFIXES if kind == "prefixes" else ""
        prefix = _words(random.Random(f"{seed}:prefix{which}"), long_tokens)
        text = f"{prefix}\n\nQuestion {index}: which of these words is about {_words(rng, 3)}?"
    else:
        raise ValueError(f"unknown prompt set {kind!r}; choose from {', '.join(PROMPT_SETS)}")
    return [{"role": "user", "content": text}]


def warmups(kind: str, warmup: int) -> int:
    """Unmeasured requests first: for `prefixes`, at least one per prefix (each in a cache)."""
    return max(warmup, NUM_PREFIXES) if kind == "prefixes" else warmup
