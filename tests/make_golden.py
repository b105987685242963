"""Regenerate the transformers oracle files that tests compare kiln against.

Loading transformers' GGUF model takes about a minute on the development machine, too slow
to repeat in every CI run, so its outputs are stored in tests/golden/. Regenerate them after
changing the prompts or the model:

    .venv/bin/python tests/make_golden.py [--model TAG] [path/to/model.gguf]

TAG picks the prompt set (default smollm2:135m); the GGUF defaults to the tag's catalogue file.
For each prompt (token ids from transformers' own tokenizer) it stores the last-position
logits, and greedy tokens with the raw log-softmax of each chosen token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
]
NUM_GREEDY = 32
GOLDEN = Path(__file__).parent / "golden"


def _long_notes(count: int = 42) -> str:
    """~700 Gemma tokens of numbered notes, so a question about an early note reaches back
    further than Gemma 3's 512-token sliding window."""
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "silver", "black"]
    animals = ["fox", "owl", "otter", "heron", "badger", "lynx", "crane", "hare", "wolf"]
    return "\n".join(f"Note {i}: the {colours[i % 8]} {animals[i * 5 % 9]} sleeps in room "
                     f"{(i * 37) % 101}." for i in range(1, count + 1))


LONG_PROMPT = [{"role": "user", "content": "Read these notes.\n" + _long_notes()
                + "\nWhich animal sleeps in room 37, and what colour is it?"}]


CODE_PROMPT = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@dataclass(frozen=True)
class GoldenSet:
    prompts: list  # chat message lists
    num_greedy: list[int]  # greedy tokens to store per prompt
    chat_template: str | None = None  # None: the GGUF's own


def golden_sets() -> dict[str, GoldenSet]:
    from kiln.runtime.store.catalogue import GEMMA_CHAT_TEMPLATE

    return {
        "smollm2:135m": GoldenSet(PROMPTS, [NUM_GREEDY] * len(PROMPTS)),
        # The GGUF carries no chat template: the catalogue's is rendered by transformers.
        "gemma3:270m": GoldenSet(PROMPTS + [LONG_PROMPT], [16] * len(PROMPTS) + [8],
                                 GEMMA_CHAT_TEMPLATE),
        "qwen2.5-coder:0.5b": GoldenSet(PROMPTS + [CODE_PROMPT], [16] * (len(PROMPTS) + 1)),
    }


def main(gguf_path: str, spec: GoldenSet) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    stem = Path(name).stem
    cases, arrays = [], {}
    for i, (messages, num_greedy) in enumerate(zip(spec.prompts, spec.num_greedy, strict=True)):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       chat_template=spec.chat_template)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        arrays[f"logits_{i}"] = logits.numpy()
        seq, greedy, logprobs = list(ids), [], []
        with torch.no_grad():
            for _ in range(num_greedy):
                step = model(torch.tensor([seq])).logits[0, -1].float()
                t = int(step.argmax())
                logprobs.append(float(torch.log_softmax(step, -1)[t]))
                greedy.append(t)
                seq.append(t)
        cases.append({"messages": messages, "text": text, "prompt_ids": ids,
                      "greedy_ids": greedy, "greedy_logprobs": logprobs})
    GOLDEN.mkdir(exist_ok=True)
    (GOLDEN / f"{stem}.json").write_text(json.dumps(cases, indent=1))
    np.savez_compressed(GOLDEN / f"{stem}.npz", **arrays)
    print(f"wrote {GOLDEN / stem}.json/.npz")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent.parent))
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="smollm2:135m", help="catalogue tag: the prompt set")
    parser.add_argument("gguf", nargs="?", help="GGUF path (default: the tag's, pulled)")
    args = parser.parse_args()
    sets = golden_sets()
    if args.model not in sets:
        parser.error(f"--model must be one of {', '.join(sets)}")
    if args.gguf:
        path = args.gguf
    else:
        from kiln.runtime.store.pull import ensure_model

        path = str(ensure_model(args.model))
    main(path, sets[args.model])
