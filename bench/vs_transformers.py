"""kiln's own forward against transformers on the same GGUF, in one run (issue "Foundation").

Reports load time, prefill tokens/s on a ~1,000-token prompt, and single-stream greedy
decode tokens/s, each beside transformers' figure measured in the same process. Usage:

    .venv/bin/python bench/vs_transformers.py [--prompt-tokens 1000] [--decode-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def kiln_figures(path: str, prompt: list[int], n_decode: int) -> dict:
    from kiln.runtime.engine.config import EngineConfig
    from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions
    from kiln.runtime.engine.llm_engine import LLMEngine
    from kiln.runtime.models.loader import load_model
    from kiln.runtime.sampling.params import SamplingParams

    t = time.perf_counter()
    loaded = load_model(path)
    load = time.perf_counter() - t
    engine = LLMEngine(loaded, EngineConfig.build(loaded.ctx_len, 2048, prefill_chunk_len=2048))
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.0)
    req = engine.make_request("p", EngineRequest(
        prompt, greedy, RequestOptions(max_tokens=n_decode, ignore_eos=True)))
    engine.add_request(req)
    t = time.perf_counter()
    engine.step()  # the whole prompt in one chunk, and the first token
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    decode = time.perf_counter() - t
    return {"load_s": load, "prefill_tok_s": len(prompt) / prefill,
            "decode_tok_s": (n_decode - 1) / decode}


def transformers_figures(path: str, prompt: list[int], n_decode: int) -> dict:
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(os.path.abspath(path))
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    load = time.perf_counter() - t
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - t
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(n_decode - 1):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - t
    return {"load_s": load, "prefill_tok_s": len(prompt) / prefill,
            "decode_tok_s": (n_decode - 1) / decode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    from kiln.runtime.store.pull import resolve_model

    path = str(resolve_model(args.model)[0])
    prompt = [(7 * i + 1000) % 40000 + 100 for i in range(args.prompt_tokens)]
    k = kiln_figures(path, prompt, args.decode_tokens)
    torch.set_num_threads(args.threads)  # transformers' matrix products are torch's own
    h = transformers_figures(path, prompt, args.decode_tokens)
    print(f"{'figure':<16}{'kiln':>12}{'transformers':>14}{'ratio':>8}")
    for key in k:
        ratio = (h[key] / k[key]) if key.startswith("load") else (k[key] / h[key])
        print(f"{key:<16}{k[key]:>12.2f}{h[key]:>14.2f}{ratio:>7.2f}x")
    print(json.dumps({"kiln": k, "transformers": h, "threads": args.threads}))


if __name__ == "__main__":
    main()
