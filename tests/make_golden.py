"""Regenerate the transformers oracle files that tests compare kiln against.

Loading transformers' GGUF model takes about a minute on the development machine, too slow
to repeat in every CI run, so its outputs are stored in tests/golden/. Regenerate them after
changing the prompts or the model:

    .venv/bin/python tests/make_golden.py [path/to/model.gguf]

For each prompt (token ids from transformers' own tokenizer) it stores the last-position
logits, and 32 greedy tokens with the raw log-softmax of each chosen token.
"""

from __future__ import annotations

import json
import os
import sys
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


def main(gguf_path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    stem = Path(name).stem
    cases, arrays = [], {}
    for i, messages in enumerate(PROMPTS):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        arrays[f"logits_{i}"] = logits.numpy()
        seq, greedy, logprobs = list(ids), [], []
        with torch.no_grad():
            for _ in range(NUM_GREEDY):
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
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        sys.path.insert(0, str(Path(__file__).parent.parent))
        from runtime.pull import ensure_model

        path = str(ensure_model("smollm2:135m"))
    main(path)
