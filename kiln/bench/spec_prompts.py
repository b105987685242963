"""The workloads of speculative decoding's benchmark (`kiln bench`'s `editing`, `quoting` and
`free` prompt sets; bench/spec.sh, bench/spec_engine.py): an editing request whose reply copies
a given function with one change, a document question answered by quoting the document, and
free writing that copies nothing."""

from __future__ import annotations

import random

SPEC_SETS = ("editing", "quoting", "free")
# Penalties off, in kiln's names and llama-server's: the sticky defaults (SmolLM2's 1.1
# repetition penalty) would otherwise make drafting change the replies it is measured on.
NEUTRAL_PENALTIES = {"repetition_penalty": 1.0, "repeat_penalty": 1.0,
                     "presence_penalty": 0.0, "frequency_penalty": 0.0}

FUNCTIONS = [
    '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages''',
    '''def parse_config(lines):
    """Key-value pairs from `key = value` lines; comments start with #."""
    config = {}
    for number, line in enumerate(lines, start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config''',
    '''def merge_intervals(intervals):
    """Overlapping [start, end] intervals merged, sorted by start."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
    '''def word_counts(text):
    """How often each word occurs in `text`, ignoring case and punctuation."""
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\\"'()")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts''',
]
RENAMES = [("values", "samples"), ("lines", "rows"), ("intervals", "ranges"),
           ("text", "document")]
DOCUMENTS = [
    "The lighthouse on Gull Point was built in 1871 from granite quarried on the island. "
    "Its lamp burned whale oil until 1889, when kerosene replaced it, and it was electrified "
    "in 1934. The last keeper, Margaret Hale, left in 1962, when the light was automated. "
    "Today the tower is a museum, open from May to October, and its lens, a second-order "
    "Fresnel lens made in Paris, still turns every night.",
    "Sourdough bread rises with a starter: flour and water in which wild yeasts and lactic "
    "acid bacteria live together. The bacteria make the acids that give the bread its sour "
    "taste, and the yeasts make the gas that lifts the dough. A starter must be fed fresh "
    "flour and water every day, or kept cold between bakes. Most bakers let the dough rise "
    "slowly overnight, which deepens its flavour.",
    "The river Ouse rises in the Pennines and flows south-east for 84 kilometres to join the "
    "Trent, forming the Humber estuary. York grew where the Romans bridged it in 71 AD. The "
    "river floods often: in 2000 it rose more than five metres above its normal level, and "
    "the city has since built barriers and pumping stations along its banks.",
]
SUBJECTS = ["a clockmaker who repairs a stranger's watch", "two children building a raft",
            "a fox that learns to read", "a night train crossing the mountains",
            "an astronaut growing tomatoes", "a lost umbrella finding its owner"]


def spec_prompt(kind: str, index: int, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}:{kind}:{index}")
    if kind == "editing":
        i = rng.randrange(len(FUNCTIONS))
        old, new = RENAMES[i]
        return [{"role": "user", "content": f"Here is a Python function:\n\n{FUNCTIONS[i]}\n\n"
                 f"Rewrite it with the variable `{old}` renamed to `{new}`. Answer with the "
                 "whole function and nothing else."}]
    if kind == "quoting":
        doc = DOCUMENTS[rng.randrange(len(DOCUMENTS))]
        return [{"role": "user", "content": f"{doc}\n\nCopy the text above word for word, then "
                 "say in one sentence what it is about."}]
    return [{"role": "user", "content": f"Write a short story about {rng.choice(SUBJECTS)}."}]
