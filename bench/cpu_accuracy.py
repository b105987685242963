"""How close kiln's default CPU path and llama.cpp are to fp32 on the same GGUF.

    .venv/bin/python bench/cpu_accuracy.py --model smollm2:135m --prompts 8 --tokens 256

llama-server (found as bench/compare.sh finds it) reads each prompt and continues it
greedily, giving its top-20 logprobs at each generated token (`n_probs`, a softmax of the
raw logits). kiln then reads the same token sequences (prompt and llama.cpp's continuation)
twice, with `--dtype float32` (the reference: the GGUF's weights dequantized exactly, fp32
arithmetic and KV cache, within 1e-4 of transformers' logits in tests/test_families.py) and
as `--dtype auto` runs (8-bit activations, fp16 KV cache), keeping the full distribution at
every continuation position. Per method:
- top-1 agreement with the reference's argmax;
- KL(reference || method) truncated to the reference's top 20 tokens, a token missing from
  the method's top 20 taken at its 20th logprob (so llama.cpp's figure is a lower bound on
  its true one); the same rule for kiln's, whose full KL is printed beside it; mean and
  median over the positions (a few positions can dominate a mean).
llama-server bans end-of-generation tokens under `ignore_eos` (their logprob is -inf in its
`n_probs`), so they are left out of both figures for every method: positions where the
reference's top token ends the reply are skipped, and such tokens are left out of the sums.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.runtime.backends.cpu.backend import CpuBackend  # noqa: E402
from kiln.runtime.engine.config import EngineConfig  # noqa: E402
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions  # noqa: E402
from kiln.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from kiln.runtime.models.loader import load_model  # noqa: E402
from kiln.runtime.sampling.params import SamplingParams  # noqa: E402

TOP = 20
PROMPTS = [
    "Explain how a hash map handles collisions, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Summarise the causes and consequences of the French Revolution.",
    "Write a bash script that backs up a directory to a dated tar file and keeps the last "
    "seven copies.",
    "What is the difference between a process and a thread? Answer for a beginner.",
    "Describe the water cycle to a ten-year-old.",
    "Write a SQL query that finds the three best-selling products of each month, and explain it.",
    "Give me a week of vegetarian dinner ideas with a shopping list.",
    "How do vaccines train the immune system?",
    "Write a Rust function that parses a comma-separated line into numbers, with error "
    "handling.",
]


def llama_server() -> str:
    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    bin_dir = Path("/root/llama.cpp/BIN_DIR")
    return (bin_dir.read_text().split()[0] + "/llama-server") if bin_dir.is_file() else \
        "llama-server"


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def llama_continuations(gguf: str, prompts: list[list[int]], tokens: int, threads: int,
                        port: int = 52790) -> list[tuple[list[int], list[dict[int, float]]]]:
    """(generated ids, their top-20 {id: logprob}) for each prompt, greedy."""
    proc = subprocess.Popen([llama_server(), "-m", gguf, "--port", str(port), "-t", str(threads),
                             "-c", "4096", "-np", "1", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        out = []
        for ids in prompts:
            r = post(f"http://127.0.0.1:{port}/completion",
                     {"prompt": ids, "n_predict": tokens, "temperature": 0, "n_probs": TOP,
                      "ignore_eos": True, "cache_prompt": False})
            probs = r["completion_probabilities"]
            out.append(([p["id"] for p in probs],
                        [{t["id"]: t["logprob"] for t in p["top_logprobs"]} for p in probs]))
        return out
    finally:
        proc.terminate()
        proc.wait()


def kiln_logprobs(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Full logprobs [len - 1, vocab] at every position of each sequence (teacher-forced)."""
    engine = LLMEngine(model, EngineConfig.build(model.ctx_len, model.max_prefill_len,
                                                 kv_cache_tokens=8192))
    inner = engine.runner.model
    captured: list[torch.Tensor] = []
    compute = inner.compute_logits

    def keep(hidden):
        logits = compute(hidden)
        captured.append(logits.float())
        return logits

    inner.compute_logits = keep
    out = []
    for i, seq in enumerate(sequences):
        captured.clear()
        engine.add_request(engine.make_request(f"a{i}", EngineRequest(
            seq, SamplingParams(temperature=0), RequestOptions(max_tokens=1, prompt_logprobs=0))))
        while engine.has_unfinished():
            engine.step()
        out.append(torch.log_softmax(torch.cat(captured)[:len(seq) - 1], -1))
    return out


def truncated_kl(ref: torch.Tensor, top: dict[int, float], skip: frozenset[int]) -> float:
    """KL(ref || q) over ref's top-20 tokens but `skip`, q's logprob from its own top 20 or
    its 20th."""
    floor = min(v for v in top.values() if v > -math.inf)
    values, ids = ref.topk(TOP)
    return sum(math.exp(lp) * (lp - top.get(t, floor)) for lp, t in zip(values.tolist(),
                                                                          ids.tolist())
               if t not in skip)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    fp32 = load_model(args.model, backend=CpuBackend())
    int8 = load_model(args.model, backend=CpuBackend(int8_products=True, kv_fp16=True))
    prompts = [fp32.chat_prompt_ids([{"role": "user", "content": p}])
               for p in PROMPTS[:args.prompts]]
    llama = llama_continuations(str(fp32.path), prompts, args.tokens, threads)
    seqs = [p + gen for p, (gen, _) in zip(prompts, llama)]
    ref, low = kiln_logprobs(fp32, seqs), kiln_logprobs(int8, seqs)
    n = agree8 = agreel = 0
    kl8, kl8_full, kll = [], [], []
    eog = fp32.tokenizer.stop_token_ids
    for p, (gen, tops), r, q in zip(prompts, llama, ref, low):
        r, q = r[len(p) - 1:], q[len(p) - 1:]  # the positions that predict the continuation
        for i, top in enumerate(tops):
            best = int(r[i].argmax())
            if best in eog:
                continue
            n += 1
            agree8 += int(q[i].argmax()) == best
            agreel += gen[i] == best
            kll.append(truncated_kl(r[i], top, eog))
            qv, qi = q[i].topk(TOP)
            kl8.append(truncated_kl(r[i], dict(zip(qi.tolist(), qv.tolist())), eog))
            kl8_full.append(float((r[i].exp() * (r[i] - q[i])).sum()))
    print(f"{args.model}: {n} positions ({len(prompts)} prompts x {args.tokens} tokens of "
          f"llama.cpp's greedy continuation, less those where the reply would end), "
          f"reference kiln --dtype float32")
    def stats(v: list[float]) -> str:
        return f"{sum(v) / n:9.6f} {statistics.median(v):9.6f}"

    print("method                    top-1  KL top-20 mean, median  KL full mean, median")
    print(f"kiln --dtype auto         {agree8 / n:.4f}  {stats(kl8):>22}  {stats(kl8_full):>20}")
    print(f"llama.cpp (llama-server)  {agreel / n:.4f}  {stats(kll):>22}  {'-':>20}")


if __name__ == "__main__":
    main()
