"""The GPU check: kiln's CUDA path against its references, then timed, one figure a line.

    bash bench/gpu_check.sh            # on the GPU machine (its python3; wheels carried)
    python bench/gpu_check.py --dry-run  # here: CPU, Triton's interpreter, tiny shapes

Models are random-weight GGUFs written here with the default model's shapes (smollm2:135m)
and one 1B-class shape (Llama 3.2 1B's), so nothing is downloaded. Sections:
  correctness: CUDA logits (fp32 and bf16, kiln's batch-invariant products and cuBLAS's)
    against the CPU torch reference on the same file; 8 replies (greedy and seeded) alone,
    inside a batch of 256 and cached, bit for bit (bench/gpu_invariance.py);
    attention at batch 256 x 4k context and at one 32k-token sequence against
    paged_attention_ref; the fused sampler's tokens against sample_ref, and its draws'
    distribution against the filtered softmax;
  timing (triton.testing.do_bench): decode attention GB/s against the H200's 4.8 TB/s; the
    fused sampler against a sort-based torch sampler at batch 1 and 256 x vocab 151,936;
    prefill attention over whole prompts, programs of 1, 2 and 4 query tiles, against
    torch's SDPA (flash), and whether the tile count moves a row's bits (gpu_prefill.py); the
    batch-invariant products against cuBLAS's at decode and prefill shapes; engine decode
    steps (no HTTP) at batch 1/16/64/256, with and without CUDA graphs, with either
    products; host syncs per step (torch's sync debug mode) and kernels compiled after load
    (should be 0); last, the peer: torch.compile (max-autotune) of a llama of the 1B
    shape, gpt-fast's recipe, at batch 1 and 64 (bench/gpu_peer.py).
A dry run does every step at toy sizes on the CPU: it shows the script works, not a figure.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:  # before triton is imported: kernels on CPU tensors run in the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from bench.gpu_invariance import check_engine, check_products  # noqa: E402
from bench.gpu_peer import time_compiled_decode  # noqa: E402
from bench.gpu_prefill import check_prefill_attention  # noqa: E402
from kiln.kernels.attention import paged_attention  # noqa: E402
from kiln.kernels.attention_ref import paged_attention_ref  # noqa: E402
from kiln.kernels.sampling import sample, tile_size, tile_warps  # noqa: E402
from kiln.kernels.sampling_metadata import SamplingMetadata  # noqa: E402
from kiln.kernels.sampling_ref import sample_ref  # noqa: E402
from kiln.runtime.backends.dense import DenseBackend  # noqa: E402
from kiln.runtime.engine.config import EngineConfig  # noqa: E402
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions  # noqa: E402
from kiln.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from kiln.runtime.kv.attention_metadata import AttentionMetadata  # noqa: E402
from kiln.runtime.models import llama  # noqa: E402
from kiln.runtime.models.loader import LoadedModel  # noqa: E402
from kiln.runtime.sampling.params import SamplingParams  # noqa: E402
from kiln.runtime.store.gguf_file import open_gguf  # noqa: E402

HBM_GBPS = 4800.0  # H200
# (layers, hidden, intermediate, heads, kv heads, head_dim, vocab)
SHAPES = {"smollm2-135m": (30, 576, 1536, 9, 3, 64, 49152),
          "llama-1b": (16, 2048, 8192, 32, 8, 64, 128256)}
DRY_SHAPES = {"smollm2-135m": (2, 384, 512, 6, 2, 64, 512)}
T0 = time.perf_counter()


def line(name: str, value, unit: str = "", note: str = "") -> None:
    value = f"{value:.4g}" if isinstance(value, float) else str(value)
    print(f"{name:52s} {value:>10s} {unit:8s} {note}".rstrip(), flush=True)


FAILED: list[str] = []


def section(name: str, fn, *args) -> None:
    """Run one section; a failure is printed (its traceback's last frames) and the check
    goes on, so one run on the lent GPU shows every failure, not only the first."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported, counted, and the exit code says so
        FAILED.append(name)
        tb = traceback.format_exc().strip().splitlines()
        line(f"{name}: FAILED", type(exc).__name__, "", str(exc).splitlines()[0][:200]
             if str(exc) else "")
        print("\n".join("    " + t for t in tb[-12:]), flush=True)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


TOKENIZER = Path(__file__).resolve().parent / "wheels" / "smollm2-tokenizer.gguf"


def write_gguf(path: Path, shape, seed: int = 0) -> Path:
    """A llama GGUF of random F16 weights, scaled 1/sqrt(fan-in) so activations keep their
    size through the layers; with the default model's tokenizer and chat template where
    bench/fetch_wheels.sh left them and the vocabulary matches (the HTTP check needs them)."""
    import gguf

    layers, hidden, inter, heads, kv_heads, head_dim, vocab = shape
    rng = np.random.default_rng(seed)

    def rand(*s):
        return (rng.standard_normal(s, dtype=np.float32) / math.sqrt(s[-1])).astype(np.float16)

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": layers, "context_length": 32768,
                       "embedding_length": hidden, "feed_forward_length": inter,
                       "attention.head_count": heads, "attention.head_count_kv": kv_heads,
                       "rope.dimension_count": head_dim, "vocab_size": vocab}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 100000.0)
    if TOKENIZER.exists():
        reader = gguf.GGUFReader(str(TOKENIZER))
        if len(reader.fields["tokenizer.ggml.tokens"].contents()) == vocab:
            for key, field in reader.fields.items():
                if key.startswith("tokenizer."):
                    sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                    w.add_key_value(key, field.contents(), field.types[0], sub)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tensor("token_embd.weight", rand(vocab, hidden) * np.float16(8))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, t in (("attn_q", rand(q, hidden)), ("attn_k", rand(kv, hidden)),
                        ("attn_v", rand(kv, hidden)), ("attn_output", rand(hidden, q)),
                        ("ffn_gate", rand(inter, hidden)), ("ffn_up", rand(inter, hidden)),
                        ("ffn_down", rand(hidden, inter))):
            w.add_tensor(p + name + ".weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build(path: Path, device: str, dtype: torch.dtype, use_triton: bool = True,
          batch_invariant: bool = False) -> LoadedModel:
    """The model on DenseBackend: Triton attention (on CUDA, or the interpreter in a dry
    run), or (use_triton=False, the reference) torch's; with batch_invariant, kiln's
    products (kiln serve's default on CUDA), otherwise cuBLAS's."""
    gf = open_gguf(path)
    cfg = llama.read_config(gf)
    backend = DenseBackend(device, dtype, use_triton=use_triton, batch_invariant=batch_invariant)
    return LoadedModel(path.stem, path, None, cfg, tokenizer=None, chat_template=None,
                       model=llama.build(cfg, gf, backend), load_seconds=0.0)


def prompt_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, read in one chunk: [T, vocab] fp32."""
    model, cfg = loaded.model, loaded.config
    dev = model.backend.device
    T, bs = len(tokens), 16
    blocks = -(-T // bs)
    caches = [model.backend.kv_cache(blocks, bs, cfg.num_kv_heads, cfg.head_dim)
              for _ in range(cfg.num_layers)]
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, T], **i32), seq_lens=torch.tensor([T], **i32),
        block_tables=torch.arange(blocks, **i32)[None], max_query_len=T, max_seq_len=T,
        slot_mapping=torch.arange(T, dtype=torch.int64, device=dev))
    ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
    positions = torch.arange(T, dtype=torch.int64, device=dev)
    with torch.inference_mode():
        hidden = model.forward(ids, positions, meta, caches)
        return model.compute_logits(hidden).float().cpu()


def check_logits(path: Path, device: str) -> None:
    rng = np.random.default_rng(1)
    ref_model = build(path, "cpu", torch.float32, use_triton=False)
    tokens = rng.integers(0, ref_model.config.vocab_size, 48 if DRY else 300).tolist()
    ref = prompt_logits(ref_model, tokens)
    del ref_model
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 8e-2)):
        if DRY and dtype == torch.bfloat16:
            continue  # bf16 products on the CPU are what --dtype bfloat16 tests cover
        for invariant in (True, False):
            got = prompt_logits(build(path, device, dtype, batch_invariant=invariant), tokens)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            products = "invariant" if invariant else "cuBLAS"
            line(f"logits {str(dtype)[6:]} {products} vs CPU reference: max err / max |logit|",
                 err, "", f"top-1 agreement {top1:.1%}  {'ok' if err < tol else 'FAIL'} "
                 f"(< {tol})")


def paged_batch(num_seqs, context, query_len, heads, kv_heads, head_dim, dtype, device,
                seed=0):
    """Random K/V for num_seqs sequences of context + query_len tokens in a shuffled cache."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: GBs
    seq_len, bs = context + query_len, 16
    blocks = -(-seq_len // bs)
    perm = torch.randperm(num_seqs * blocks, generator=g, device=device)
    shape = (num_seqs * blocks, bs, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    query = torch.randn((num_seqs * query_len, heads, head_dim), generator=g,
                        device=device).to(dtype)
    i32 = dict(dtype=torch.int32, device=device)
    return (query, key_cache, value_cache, perm.view(num_seqs, blocks).to(torch.int32),
            torch.full((num_seqs,), seq_len, **i32),
            torch.arange(0, num_seqs * query_len + 1, query_len, **i32)), seq_len


def check_attention(device: str) -> None:
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    cases = [("batch 256 x 4k decode", 256, 4096, 1), ("one 32k-token decode", 1, 32768, 1),
             ("512-token chunk at 16k context", 1, 16384, 512)]
    if DRY:
        cases = [("batch 3 x 520 decode", 3, 520, 1), ("chunk of 20 at 530", 1, 530, 20)]
    for name, num_seqs, context, query_len in cases:
        args, seq_len = paged_batch(num_seqs, context, query_len, 9, 3, 64, dt, device)
        out = paged_attention(*args, scale=0.125, max_seq_len=seq_len)
        ref = paged_attention_ref(*args, scale=0.125)
        err = (out.float() - ref.float()).abs().max().item()
        tol = 2e-2 if dt == torch.bfloat16 else 1e-4
        line(f"attention {name} vs reference: max abs err", err, "",
             "ok" if err < tol else f"FAIL (>= {tol})")
        if query_len == 1:  # decode steps take a program per sequence: the same bits
            same = torch.equal(out, paged_attention(*args, scale=0.125, max_seq_len=seq_len,
                                                    max_query_len=1))
            line(f"attention {name}: decode grid bits equal the general grid's", same, "",
                 "ok" if same else "FAIL")


def sampling_batch(B: int, V: int, dtype, device, seed=0) -> tuple[torch.Tensor, SamplingMetadata]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn((B, V), generator=g) * 3).to(device, dtype)
    rows = torch.arange(B)
    f32 = dict(dtype=torch.float32, device=device)
    temperature = torch.where(rows % 4 == 0, 0.0, 0.7 + (rows % 3) * 0.2).to(**f32)
    top_k = torch.where(rows % 5 == 1, 40, 0).to(torch.int32).to(device)
    top_p = torch.where(rows % 3 == 2, 0.9, 1.0).to(**f32)
    min_p = torch.where(rows % 7 == 3, 0.05, 0.0).to(**f32)
    ones, zeros = torch.ones(B, **f32), torch.zeros(B, **f32)
    md = SamplingMetadata(temperature, top_k, top_p, min_p, ones, zeros, zeros, None,
                          seeds=rows.to(torch.int64).to(device) * 7919,
                          offsets=torch.zeros(B, dtype=torch.int64, device=device),
                          grammar_bitmask=None, num_top_logprobs=1)
    return logits, md


def torch_sort_sampler(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The common torch sampler: temperature, a full sort, top-k and top-p masks, a draw."""
    x = logits.float() / md.temperature.clamp(min=1e-5)[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where(md.top_k > 0, md.top_k, x.shape[1]).long()
    pos = torch.arange(x.shape[1], device=x.device)[None]
    sorted_x = sorted_x.masked_fill(pos >= k[:, None], float("-inf"))
    probs = sorted_x.softmax(-1)
    cut = probs.cumsum(-1) - probs > md.top_p[:, None]
    probs = probs.masked_fill(cut, 0.0)
    return order.gather(1, torch.multinomial(probs, 1))[:, 0]


def check_sampler(device: str) -> None:
    B, V = (256, 151936) if not DRY else (8, 3000)
    logits, md = sampling_batch(B, V, torch.bfloat16 if device == "cuda" else torch.float32,
                                device)
    got, want = sample(logits, md), sample_ref(logits, md)
    same = (got.token_ids == want.token_ids).float().mean().item()
    line(f"sampler {B} x {V}: tokens equal to sample_ref", f"{same:.2%}", "",
         "ok" if same == 1.0 else "FAIL")
    # Distribution: one row's filtered softmax against its draws over N seeds.
    N, V2 = (20000, 1000) if not DRY else (200, 100)
    row = torch.randn(V2, generator=torch.Generator().manual_seed(5)) * 2
    f32 = dict(dtype=torch.float32, device=device)
    md2 = SamplingMetadata(torch.full((N,), 0.8, **f32),
                           torch.full((N,), 50, dtype=torch.int32, device=device),
                           torch.full((N,), 0.95, **f32), torch.zeros(N, **f32),
                           torch.ones(N, **f32), torch.zeros(N, **f32), torch.zeros(N, **f32),
                           None, torch.arange(N, dtype=torch.int64, device=device),
                           torch.zeros(N, dtype=torch.int64, device=device), None)
    drawn = sample(row.to(device)[None].expand(N, V2).contiguous(), md2).token_ids.cpu()
    x = row / 0.8
    keep = x >= x.topk(50).values[-1]
    p = torch.where(keep, x, float("-inf")).softmax(-1)
    sp, order = p.sort(descending=True)
    keep_p = torch.zeros_like(keep)
    keep_p[order[(sp.cumsum(0) - sp) < 0.95]] = True
    p = torch.where(keep_p, p, 0.0)
    p = p / p.sum()
    freq = torch.bincount(drawn, minlength=V2).double() / N
    tv = 0.5 * (freq - p.double()).abs().sum().item()
    # E[TV] of N draws from k cells is about sqrt(k / (2 pi N)): allow 2.5 times that.
    bound = math.sqrt(int(keep_p.sum()) / N)
    line(f"sampler draws ({N}) vs filtered softmax: total variation", tv, "",
         "ok" if tv < bound else f"FAIL (>= {bound:.3f})")


def bench(fn) -> float:
    """Milliseconds per call: triton.testing.do_bench on a GPU; a rough clock in a dry run."""
    if not DRY:
        return triton.testing.do_bench(fn, warmup=25, rep=200)
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def time_kernels(device: str) -> None:
    note = "(dry run: CPU interpreter)" if DRY else ""
    for model, (_, _, _, heads, kv_heads, head_dim, _) in SHAPES.items():
        num_seqs, context = (256, 4096) if not DRY else (2, 520)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        args, seq_len = paged_batch(num_seqs, context, 1, heads, kv_heads, head_dim, dt, device)
        ms = bench(lambda args=args, seq_len=seq_len: paged_attention(
            *args, scale=0.125, max_seq_len=seq_len, max_query_len=1))
        general = bench(lambda args=args, seq_len=seq_len: paged_attention(
            *args, scale=0.125, max_seq_len=seq_len))
        kv_bytes = 2 * num_seqs * seq_len * kv_heads * head_dim * dt.itemsize
        gbps = kv_bytes / ms / 1e6
        line(f"attention decode {model} {num_seqs} x {context}", ms, "ms",
             f"{gbps:.0f} GB/s = {gbps / HBM_GBPS:.0%} of {HBM_GBPS:.0f}; general grid "
             f"{general:.3f} ms: {general / ms:.2f}x {note}")
        if DRY:
            break
    for B, V in [(1, 151936), (256, 151936)] if not DRY else [(4, 3000)]:
        logits, md = sampling_batch(B, V, torch.bfloat16 if device == "cuda" else torch.float32,
                                    device)
        fused = bench(lambda x=logits, m=md: sample(x, m))
        sort = bench(lambda x=logits, m=md: torch_sort_sampler(x, m))
        line(f"fused sampler {B} x {V}", fused, "ms", f"torch sort-based {sort:.3f} ms: "
             f"{sort / fused:.2f}x {note}")


def serving_batch(B: int, V: int, device, seed=0) -> tuple[torch.Tensor, SamplingMetadata]:
    """What a served batch asks of the sampler: the default model's settings (temperature
    0.2, top_k 40, top_p 0.9, min_p 0.1, repetition 1.1 over a 64-token window), bf16."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn((B, V), generator=g) * 3).to(device, torch.bfloat16)
    f32 = dict(dtype=torch.float32, device=device)

    def full(v, **kw):
        return torch.full((B,), v, **(kw or f32))
    window = torch.randint(0, V, (B, 64), generator=g).to(device)
    md = SamplingMetadata(full(0.2), full(40, dtype=torch.int32, device=device), full(0.9),
                          full(0.1), full(1.1), full(0.0), full(0.0), window,
                          seeds=torch.arange(B, dtype=torch.int64, device=device),
                          offsets=torch.zeros(B, dtype=torch.int64, device=device),
                          grammar_bitmask=None, num_top_logprobs=0)
    return logits, md


def sweep_sampler(device: str) -> None:
    """The fused sampler's tile width and warps at served batch shapes, against the
    sort-based torch sampler: the data to choose the defaults by."""
    shapes = [(1, 49152), (16, 49152), (256, 49152), (1, 151936), (256, 151936)]
    configs = [(tile, warps) for tile in (256, 512, 1024, 2048) for warps in (4, 8, 16)]
    if DRY:
        shapes, configs = [(2, 3000)], [(tile_size(3000), 4), (256, 4)]
    for B, V in shapes:
        default = (tile_size(V), tile_warps(tile_size(V)))
        logits, md = serving_batch(B, V, device)
        want = sample(logits, md).token_ids
        times = {}
        for tile, warps in configs:
            out = sample(logits, md, tile=tile, warps=warps)
            if not torch.equal(out.token_ids, want):
                line(f"sampler sweep {B} x {V} tile {tile} warps {warps}", "FAIL", "",
                     "tokens differ from the default launch")
                continue
            times[tile, warps] = bench(lambda t=tile, w=warps, x=logits, m=md: sample(
                x, m, tile=t, warps=w))
        sort = bench(lambda x=logits, m=md: torch_sort_sampler(x, m))
        best = min(times, key=times.get)
        default_ms = times.get(default) or bench(lambda x=logits, m=md: sample(x, m))
        line(f"sampler sweep {B} x {V}: default {default[0]}/{default[1]}", default_ms, "ms",
             f"best {best[0]}/{best[1]} {times[best]:.3f} ms; torch sort {sort:.3f} ms")
        print("    " + "  ".join(f"{t}/{w}={ms:.3f}" for (t, w), ms in sorted(times.items())),
              flush=True)


def check_serving(path: Path, device: str) -> None:
    """`kiln serve` on the device, over HTTP: a chat reply whole and streamed (the same
    text), n=4 seeded choices, an echoed prompt's logprobs, then 64 concurrent streams
    (tokens/s, time to first token), then SIGTERM (exit 0). Random weights: text is noise."""
    import asyncio
    import json
    import signal
    import socket
    import subprocess

    import httpx

    if DRY:  # the CPU serves the real default model: the steps are checked, not figures
        from kiln.runtime.store.pull import ensure_model
        path = Path(ensure_model("smollm2:135m"))
    elif not TOKENIZER.exists():
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
           "--kv-cache-tokens", "65536" if not DRY else "4096", "--ctx-len", "4096"]
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
                   "max_tokens": 128 if not DRY else 4, "temperature": 0.8, "seed": i,
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

        for c in (1, 64) if not DRY else (2,):
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


_LOADED: dict[tuple[Path, str, bool], LoadedModel] = {}


def loaded_model(path: Path, device: str, invariant: bool) -> LoadedModel:
    """One model at a time in memory: the last one asked for."""
    if (path, device, invariant) not in _LOADED:
        _LOADED.clear()
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        _LOADED[path, device, invariant] = build(path, device, dt, batch_invariant=invariant)
    return _LOADED[path, device, invariant]


def prefill(engine: LLMEngine, rng, params: SamplingParams, B: int, tag: str) -> float:
    """Seconds until B new 128-token prompts each have their first token."""
    for i in range(B):
        prompt = rng.integers(0, engine.vocab_size, 128).tolist()
        engine.add_request(engine.make_request(f"{B}-{tag}{i}", EngineRequest(
            prompt, params, RequestOptions(max_tokens=800, ignore_eos=True))))
    t0 = time.perf_counter()
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    return time.perf_counter() - t0


def time_engine(path: Path, device: str, label: str, batches, graphs: bool,
                invariant: bool) -> None:
    """Engine steps without HTTP: the prefill of B 128-token prompts, then decode steps."""
    loaded = loaded_model(path, device, invariant)
    compiled_after_load = []
    mode = ("graphs" if graphs else "eager") + (" invariant" if invariant else " cuBLAS")
    config = EngineConfig(ctx_len=1024 if DRY else 4096, prefill_chunk_len=2048,
                          kv_cache_tokens=max(batches) * 256 + 4096,
                          max_num_seqs=max(batches), device=device, use_triton=True,
                          cuda_graphs=graphs)  # off CUDA the padded buckets replay eagerly
    t0 = time.perf_counter()
    engine = LLMEngine(loaded, config)
    line(f"engine load {label} {mode} (warm-up, capture)", time.perf_counter() - t0, "s")
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled_after_load.append(1)
    try:
        rng = np.random.default_rng(2)
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=3)

        for B in batches:
            # Twice at the largest batch: the first prefill of a size meets the allocator's
            # first blocks of each activation shape; an engine's second shows what is left
            # (issue 27: graphs mode prefilled slower than eager, the engine made first).
            again = ""
            if B == max(batches) and not DRY:
                again_s = prefill(engine, rng, params, B, "warm")
                for rid in list(engine.requests):
                    engine.abort(rid)
                again = f" (the first prefill of this size took {again_s * 1000:.0f} ms)"
            prefill_s = prefill(engine, rng, params, B, "")
            steps = 2 if DRY else 48
            for _ in range(2):
                engine.step()
            syncs = "n/a (CPU)"
            if device == "cuda":
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    engine.step()
                    torch.cuda.set_sync_debug_mode("default")
                syncs = str(sum("synchroniz" in str(w.message) for w in caught))
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            ms = (time.perf_counter() - t0) / steps * 1000
            line(f"decode step {label} batch {B} {mode}", ms, "ms",
                 f"{B / ms * 1000:.0f} tok/s; host syncs in a step: {syncs}; prefill "
                 f"{B} x 128 in {prefill_s * 1000:.0f} ms{again}")
            for rid in list(engine.requests):
                engine.abort(rid)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
        del engine  # its KV cache, before the next one is allocated
    if DRY:
        line(f"kernels compiled after load ({label} {mode})", "n/a", "", "(the interpreter "
             "compiles nothing: tests/test_aot_compile.py checks the variants)")
    else:
        line(f"kernels compiled after load ({label} {mode})", len(compiled_after_load), "",
             "ok" if not compiled_after_load else "FAIL: a step met a variant not warmed")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreter, toy shapes")
    p.add_argument("--skip-1b", action="store_true")
    p.add_argument("--sampler-sweep", action="store_true",
                   help="time the fused sampler's launch parameters at served shapes")
    args = p.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (dry run)"
    line("device", gpu, "", f"torch {torch.__version__}, triton {triton.__version__}")
    shapes = DRY_SHAPES if DRY else SHAPES
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, shape in shapes.items():
            if name == "llama-1b" and args.skip_1b:
                continue
            t0 = time.perf_counter()
            paths[name] = write_gguf(Path(tmp) / f"{name}.gguf", shape)
            line(f"wrote random-weight {name}.gguf", time.perf_counter() - t0, "s")
        section("logits", check_logits, paths["smollm2-135m"], device)
        section("attention", check_attention, device)
        section("sampler", check_sampler, device)
        section("kernel timings", time_kernels, device)
        section("prefill attention", check_prefill_attention, device, DRY, line, bench)
        if args.sampler_sweep:
            section("sampler sweep", sweep_sampler, device)
        batches = (1, 16, 64, 256) if not DRY else (1, 3)
        section("products", check_products, device, DRY, line, bench)
        section("serving", check_serving, paths["smollm2-135m"], device)
        for invariant in (True, False):
            section(f"replies alone, batched, cached, invariant={invariant}", lambda i=invariant:
                    check_engine(loaded_model(paths["smollm2-135m"], device, i), device, DRY,
                                 line))
        # kiln serve's default (graphs, batch-invariant products), cuBLAS's products beside
        # it, and eager steps
        for graphs, invariant in ((True, True), (True, False), (False, True)):
            section(f"engine smollm2-135m graphs={graphs} invariant={invariant}", time_engine,
                    paths["smollm2-135m"], device, "smollm2-135m", batches, graphs, invariant)
        if "llama-1b" in paths:
            for invariant in (True, False):
                section(f"engine llama-1b graphs=True invariant={invariant}", time_engine,
                        paths["llama-1b"], device, "llama-1b", (1, 64), True, invariant)
        # The peer, last (max-autotune's compile takes minutes): the 1B shape (the toy one in
        # a dry run) under torch.compile.
        peer = "llama-1b" if "llama-1b" in paths else "smollm2-135m"
        section(f"torch.compile {peer}", time_compiled_decode, shapes[peer], peer,
                (1, 64) if not DRY else (1, 3), 128, device, DRY, line)
    line("total", time.perf_counter() - T0, "s", f"failed sections: {', '.join(FAILED)}"
         if FAILED else "every section ran")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
