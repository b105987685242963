"""bench/gpu_check.py's serving section: `kiln serve` on the device, over HTTP.

A section takes the check's own `line` (one figure a line).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path


def check_serving(path: Path, device: str, dry: bool, line, tokenizer: Path) -> None:
    """`kiln serve` on the device, over HTTP: a chat reply whole and streamed (the same
    text), n=4 seeded choices, an echoed prompt's logprobs, then 64 concurrent streams
    (tokens/s, time to first token), then SIGTERM (exit 0). Random weights: text is noise."""
    import asyncio
    import json
    import signal
    import socket
    import subprocess

    import httpx

    if dry:  # the CPU serves the real default model: the steps are checked, not figures
        from kiln.runtime.store.pull import ensure_model
        path = Path(ensure_model("smollm2:135m"))
    elif not tokenizer.exists():
        line("serving", "skipped", "", "no bench/wheels/smollm2-tokenizer.gguf (fetch_wheels)")
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.gettempdir()) / f"kiln-serve-{port}.log"
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "kiln.api.cli", "serve", str(path), "--port", str(port),
           "--kv-cache-tokens", "65536" if not dry else "4096", "--ctx-len", "4096"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited {proc.returncode}: "
                                   f"{log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 240:
                raise RuntimeError("kiln serve not healthy after 240 s")
            time.sleep(0.25)
        line("serving: kiln serve healthy after", time.perf_counter() - t0, "s")
        messages = [{"role": "user", "content": "Name three colours."}]
        body = {"messages": messages, "max_tokens": 16, "temperature": 0}
        whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        text = whole["choices"][0]["message"]["content"]
        streamed = ""
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as r:
            for raw in r.iter_lines():
                if raw.startswith("data: {"):
                    for c in json.loads(raw[6:])["choices"]:
                        streamed += c["delta"].get("content") or ""
        line("serving: greedy chat, whole vs streamed", whole["usage"]["completion_tokens"],
             "tokens", "ok" if streamed == text else "FAIL: streamed text differs")
        n = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            **body, "n": 4, "seed": 1, "temperature": 1.0}).json()
        texts = [c["message"]["content"] for c in n["choices"]]
        line("serving: n=4 seeded choices", len(set(texts)), "distinct",
             "ok" if len(texts) == 4 else "FAIL")
        echo = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": "The sky is blue and", "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0}).json()
        lp = echo["choices"][0]["logprobs"]
        ok = lp["token_logprobs"][0] is None and all(
            isinstance(v, float) for v in lp["token_logprobs"][1:])
        line("serving: echo logprobs entries", len(lp["tokens"]), "", "ok" if ok else "FAIL")

        async def one(client: httpx.AsyncClient, i: int) -> tuple[float, int]:
            start, first, count = time.perf_counter(), None, 0
            req = {"messages": [{"role": "user", "content": f"Story {i}"}], "stream": True,
                   "max_tokens": 128 if not dry else 4, "temperature": 0.8, "seed": i,
                   "ignore_eos": True}
            async with client.stream("POST", f"{url}/v1/chat/completions", json=req) as r:
                async for raw in r.aiter_lines():
                    if raw.startswith("data: {") and json.loads(raw[6:])["choices"]:
                        first = first or time.perf_counter()
                        count += 1
            return first - start, count

        async def load(c: int):
            async with httpx.AsyncClient(timeout=300) as client:
                t = time.perf_counter()
                results = await asyncio.gather(*(one(client, i) for i in range(c)))
                return time.perf_counter() - t, results

        for c in (1, 64) if not dry else (2,):
            wall, results = asyncio.run(load(c))
            chunks = sum(k for _, k in results)
            ttft = sorted(t for t, _ in results)[len(results) // 2]
            line(f"serving: {c} concurrent streams", chunks / wall, "chunks/s",
                 f"median TTFT {ttft * 1000:.0f} ms, {wall:.2f} s wall (HTTP included)")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        line("serving: SIGTERM", code, "exit", "ok" if code == 0 else "FAIL")
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
