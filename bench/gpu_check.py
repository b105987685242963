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
The sections live beside this file (gpu_sampler.py, gpu_prefill.py, gpu_invariance.py,
gpu_serving.py, gpu_engine.py, gpu_peer.py); this one writes the models and runs them in turn.
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
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:  # before triton is imported: kernels on CPU tensors run in the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from bench.gpu_engine import time_engine  # noqa: E402
from bench.gpu_invariance import check_engine, check_products  # noqa: E402
from bench.gpu_peer import time_compiled_decode  # noqa: E402
from bench.gpu_prefill import check_prefill_attention  # noqa: E402
from bench.gpu_sampler import (  # noqa: E402
    check_sampler,
    sampling_batch,
    sweep_sampler,
    torch_sort_sampler,
)
from bench.gpu_serving import check_serving  # noqa: E402
from kiln.kernels.attention import TILE_ROWS, paged_attention  # noqa: E402
from kiln.kernels.attention_ref import paged_attention_ref  # noqa: E402
from kiln.kernels.sampling import sample  # noqa: E402
from kiln.runtime.backends.dense import DenseBackend  # noqa: E402
from kiln.runtime.kv.attention_metadata import AttentionMetadata  # noqa: E402
from kiln.runtime.models import llama  # noqa: E402
from kiln.runtime.models.loader import LoadedModel  # noqa: E402
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
            for rows in (TILE_ROWS, 64):  # kiln's tiles, and a warpgroup's (gpu_prefill.py)
                general = out if rows == TILE_ROWS else paged_attention(
                    *args, scale=0.125, max_seq_len=seq_len, rows=rows)
                same = torch.equal(general, paged_attention(
                    *args, scale=0.125, max_seq_len=seq_len, max_query_len=1, rows=rows))
                line(f"attention {name}: decode grid bits equal the general grid's, "
                     f"{rows}-row tiles", same, "", "ok" if same else "FAIL")


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
        wide = bench(lambda args=args, seq_len=seq_len: paged_attention(
            *args, scale=0.125, max_seq_len=seq_len, max_query_len=1, rows=64))
        kv_bytes = 2 * num_seqs * seq_len * kv_heads * head_dim * dt.itemsize
        gbps = kv_bytes / ms / 1e6
        line(f"attention decode {model} {num_seqs} x {context}", ms, "ms",
             f"{gbps:.0f} GB/s = {gbps / HBM_GBPS:.0%} of {HBM_GBPS:.0f}; general grid "
             f"{general:.3f} ms: {general / ms:.2f}x; 64-row tiles {wide:.3f} ms: "
             f"{wide / ms:.2f}x {note}")
        if DRY:
            break
    for B, V in [(1, 151936), (256, 151936)] if not DRY else [(4, 3000)]:
        logits, md = sampling_batch(B, V, torch.bfloat16 if device == "cuda" else torch.float32,
                                    device)
        fused = bench(lambda x=logits, m=md: sample(x, m))
        sort = bench(lambda x=logits, m=md: torch_sort_sampler(x, m))
        line(f"fused sampler {B} x {V}", fused, "ms", f"torch sort-based {sort:.3f} ms: "
             f"{sort / fused:.2f}x {note}")


_LOADED: dict[tuple[Path, str, bool], LoadedModel] = {}


def loaded_model(path: Path, device: str, invariant: bool) -> LoadedModel:
    """One model at a time in memory: the last one asked for."""
    if (path, device, invariant) not in _LOADED:
        _LOADED.clear()
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        _LOADED[path, device, invariant] = build(path, device, dt, batch_invariant=invariant)
    return _LOADED[path, device, invariant]


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
        section("sampler", check_sampler, device, DRY, line)
        section("kernel timings", time_kernels, device)
        section("prefill attention", check_prefill_attention, device, DRY, line, bench)
        if args.sampler_sweep:
            section("sampler sweep", sweep_sampler, device, DRY, line, bench)
        batches = (1, 16, 64, 256) if not DRY else (1, 3)
        section("products", check_products, device, DRY, line, bench)
        section("serving", check_serving, paths["smollm2-135m"], device, DRY, line, TOKENIZER)
        for invariant in (True, False):
            section(f"replies alone, batched, cached, invariant={invariant}", lambda i=invariant:
                    check_engine(loaded_model(paths["smollm2-135m"], device, i), device, DRY,
                                 line))
        # kiln serve's default (graphs, batch-invariant products), cuBLAS's products beside
        # it, and eager steps
        for graphs, invariant in ((True, True), (True, False), (False, True)):
            section(f"engine smollm2-135m graphs={graphs} invariant={invariant}", lambda g=graphs,
                    i=invariant: time_engine(loaded_model(paths["smollm2-135m"], device, i),
                                             device, DRY, line, "smollm2-135m", batches, g, i))
        if "llama-1b" in paths:
            for invariant in (True, False):
                section(f"engine llama-1b graphs=True invariant={invariant}", lambda i=invariant:
                        time_engine(loaded_model(paths["llama-1b"], device, i), device, DRY,
                                    line, "llama-1b", (1, 64), True, i))
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
