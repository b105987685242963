"""kiln's C kernels from two trees side by side: attention (decode rows and prefill chunks) and
the products on 8-bit activations, in alternating rounds in one process; or, with --engine,
the engine's decode steps on each tree's kernels.

    .venv/bin/python bench/cpu_kernels.py OLD_TREE NEW_TREE [--flags=-mno-avx512f]
    .venv/bin/python bench/cpu_kernels.py OLD_TREE NEW_TREE --engine smollm2:135m --batch 1,2

Each tree's csrc/ is built with the flags kiln builds with, plus --flags (`-mno-avx512f`
times the AVX2 build on an AVX-512 machine), and loaded beside the other. Every case runs
in each build in turn, rounds alternating which goes first; a kernel's figure is the lowest
of the rounds' lower quartiles, an engine's the median of its rounds (each a fresh batch of
greedy requests with --context prompt tokens, --steps decode steps timed). The ratio
old / new is what to quote (above 1: new is faster): the machine is shared, so only the
ratios mean anything, and this file's own Python (the working tree's) drives both.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.runtime.backends.cpu import library  # noqa: E402
from kiln.runtime.backends.cpu.backend import CpuBackend  # noqa: E402
from kiln.runtime.engine.bootstrap import EngineOptions, build_engine  # noqa: E402
from kiln.runtime.engine.engine_request import EngineRequest, RequestOptions  # noqa: E402
from kiln.runtime.sampling.params import SamplingParams  # noqa: E402
from kiln.runtime.store.gguf_file import WeightSource  # noqa: E402

HEADS = (9, 3, 64)  # smollm2:135m's query heads, KV heads, head size
BS = 16
# (sequences, context, query positions each, layers): decode rows, prefill chunks; with 30
# layers each call reads the next layer's cache, as a forward does (K/V from memory, not L3)
ATTENTION = [(1, 300, 1, 1), (64, 300, 1, 1), (16, 300, 1, 30), (64, 300, 1, 30),
             (2, 512, 256, 1), (1, 640, 640, 1)]
# (type, rows of x, outputs): smollm2's gate and up projections together, and its LM head;
# 9 rows: one stream checking 8 drafted tokens; Q5_0 is qwen2.5-coder's and gemma3's
PRODUCTS = [(Q.Q4_1, 1, 3072), (Q.Q4_1, 9, 3072), (Q.Q4_1, 16, 3072), (Q.Q4_1, 64, 3072),
            (Q.Q4_1, 256, 3072), (Q.Q8_0, 1, 3072), (Q.Q8_0, 64, 3072),
            (Q.Q8_0, 1, 49152), (Q.Q8_0, 4, 49152), (Q.Q8_0, 9, 49152),
            (Q.Q5_0, 1, 3072), (Q.Q5_0, 16, 3072), (Q.Q5_0, 64, 3072)]
K = 576


def build(tree: Path, flags: list[str], out: Path) -> ctypes.CDLL:
    srcs = sorted((tree / "kiln/runtime/backends/cpu/csrc").glob("*.c"))
    subprocess.run(["cc", *library.FLAGS, *flags, "-o", str(out), *map(str, srcs)], check=True)
    lib = ctypes.CDLL(str(out))
    for name, (args, res) in library.SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def backend(lib: ctypes.CDLL, key: tuple[str, ...]) -> CpuBackend:
    library._loaded[key] = lib  # the backend takes its library from the loader's table
    return CpuBackend(kv_fp16=True, extra_flags=key, int8_products=True)


def attention_case(be: CpuBackend, seqs: int, ctx: int, ql: int, layers: int):
    H, KVH, D = HEADS
    g = torch.Generator().manual_seed(0)
    nb = -(-ctx // BS)
    caches = []
    for _ in range(layers):
        kc, vc = be.kv_cache(seqs * nb, BS, KVH, D)
        kc.copy_(torch.randn(kc.shape, generator=g))
        vc.copy_(torch.randn(vc.shape, generator=g))
        caches.append((kc, vc))
    tables = torch.randperm(seqs * nb, generator=g).int().view(seqs, nb).contiguous()
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, dtype=torch.int32) * ql
    q = torch.randn(seqs * ql, H, D, generator=g)
    out = torch.empty(seqs * ql, H * D)

    def run():
        for kc, vc in caches:
            be.lib.kiln_attention(q.data_ptr(), H * D, D, kc.data_ptr(), vc.data_ptr(),
                                  tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
                                  qsl.data_ptr(), seqs, H, KVH, D, D ** -0.5, 0,
                                  out.data_ptr(), H * D, D, 1, be.threads)
    return run


def product_case(be: CpuBackend, qtype, rows: int, N: int):
    w = np.random.default_rng(1).standard_normal((N, K), dtype=np.float32) * np.float32(0.05)
    raw = np.ascontiguousarray(quants.quantize(w, qtype)).view(np.uint8).reshape(N, -1)
    linear = be.linear([WeightSource("w", qtype, N, K, raw)])
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(2))
    return lambda: linear(x)


def lower_quartile_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 4] * 1e3


def engine_rounds(libs: dict[str, ctypes.CDLL], args) -> None:
    """Decode steps of one engine per build, in alternating rounds. Each is built, and
    stepped, while its library is the loader's default: the backend takes it at the build,
    the sampler at each call (two libraries in use at once are two thread pools, whose
    spinning workers take each other's cores)."""
    native = library._loaded.get(())
    engines = {}
    for n, lib in libs.items():
        library._loaded[()] = lib
        engines[n] = build_engine(args.engine, EngineOptions(
            dtype="auto", max_num_seqs=max(args.batch),
            kv_cache_tokens=max(args.batch) * (args.context + args.steps + 64) + 256))[1]
    if native is not None:
        library._loaded[()] = native
    for batch in args.batch:
        ms: dict[str, list[float]] = {n: [] for n in engines}
        for r in range(args.rounds):
            for n in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                e, library._loaded[()] = engines[n], libs[n]
                reqs = [e.make_request(f"{n}{r}-{i}", EngineRequest(
                    list(range(1000 + i, 1000 + i + args.context)), SamplingParams(),
                    RequestOptions(max_tokens=args.steps + 64, ignore_eos=True)))
                    for i in range(batch)]
                for q in reqs:
                    e.add_request(q)
                while any(q.num_output_tokens == 0 for q in reqs):  # prefill
                    e.step()
                e.step()
                t = time.perf_counter()
                for _ in range(args.steps):
                    e.step()
                ms[n].append((time.perf_counter() - t) / args.steps * 1e3)
                for q in reqs:
                    e.abort(q.request_id)
        old, new = statistics.median(ms["old"]), statistics.median(ms["new"])
        if native is not None:
            library._loaded[()] = native
        print(f"{args.engine} batch {batch:3d}: old {old:7.2f} ms/step  new {new:7.2f} "
              f"ms/step  old/new {old / new:5.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--flags", default="", help="added to kiln's build flags, e.g. -mno-avx512f")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="", help="the cases whose names contain this")
    ap.add_argument("--engine", default="", help="a model: time its engine's decode steps")
    ap.add_argument("--batch", default="1", help="with --engine: batch sizes, e.g. 1,2,16")
    ap.add_argument("--context", type=int, default=300, help="with --engine: prompt tokens")
    ap.add_argument("--steps", type=int, default=24, help="with --engine: steps a round")
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    flags = args.flags.split()
    print(f"# {args.old} (old) against {args.new} (new), flags {flags or 'none'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(tree, flags, Path(tmp) / f"{name}.so")
                for name, tree in (("old", args.old), ("new", args.new))}
        if args.engine:
            engine_rounds(libs, args)
            return
        bes = {name: backend(lib, (f"bench-{name}",)) for name, lib in libs.items()}
        cases: dict[str, dict[str, object]] = {}
        for seqs, ctx, ql, layers in ATTENTION:
            name = f"attention {seqs} x {ctx} ctx, {ql} q" + (f", {layers} layers" * (layers > 1))
            cases[name] = {n: attention_case(be, seqs, ctx, ql, layers) for n, be in bes.items()}
        for qtype, rows, N in PRODUCTS:
            cases[f"product {qtype.name} {rows} x {K} x {N}"] = {
                n: product_case(be, qtype, rows, N) for n, be in bes.items()}
        cases = {c: fns for c, fns in cases.items() if args.only in c}
        best = {(c, n): float("inf") for c in cases for n in bes}
        for r in range(args.rounds):
            for case, fns in cases.items():
                for n in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    best[case, n] = min(best[case, n], lower_quartile_ms(fns[n], args.reps))
    for case in cases:
        old, new = best[case, "old"], best[case, "new"]
        print(f"{case:47s} old {old:8.3f} ms  new {new:8.3f} ms  old/new {old / new:5.2f}x")


if __name__ == "__main__":
    main()
