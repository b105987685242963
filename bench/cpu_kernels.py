"""kiln's C kernels from two trees side by side: attention (decode rows and prefill chunks) and
the products on 8-bit activations, in alternating rounds in one process.

    .venv/bin/python bench/cpu_kernels.py OLD_TREE NEW_TREE [--flags=-mno-avx512f]

Each tree's csrc/ is built with the flags kiln builds with, plus --flags (`-mno-avx512f`
times the AVX2 build on an AVX-512 machine), and loaded beside the other. Every case runs
in each build in turn, rounds alternating which goes first; the figure is the lowest of
the rounds' lower quartiles, and the ratio old / new is what to quote (above 1: new is
faster). The machine is shared, so only the ratios mean anything.
"""

from __future__ import annotations

import argparse
import ctypes
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
from kiln.runtime.store.gguf_file import WeightSource  # noqa: E402

HEADS = (9, 3, 64)  # smollm2:135m's query heads, KV heads, head size
BS = 16
# (sequences, context, query positions each): decode rows, prefill chunks
ATTENTION = [(1, 300, 1), (64, 300, 1), (2, 512, 256), (1, 640, 640)]
PRODUCTS = [(Q.Q4_1, 1), (Q.Q4_1, 64), (Q.Q4_1, 256), (Q.Q8_0, 1), (Q.Q8_0, 64)]
N, K = 3072, 576  # smollm2's gate and up projections together


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


def attention_case(be: CpuBackend, seqs: int, ctx: int, ql: int):
    H, KVH, D = HEADS
    g = torch.Generator().manual_seed(0)
    nb = -(-ctx // BS)
    kc, vc = be.kv_cache(seqs * nb, BS, KVH, D)
    kc.copy_(torch.randn(kc.shape, generator=g))
    vc.copy_(torch.randn(vc.shape, generator=g))
    tables = torch.randperm(seqs * nb, generator=g).int().view(seqs, nb).contiguous()
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, dtype=torch.int32) * ql
    q = torch.randn(seqs * ql, H, D, generator=g)
    out = torch.empty(seqs * ql, H * D)

    def run():
        be.lib.kiln_attention(q.data_ptr(), H * D, D, kc.data_ptr(), vc.data_ptr(),
                              tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
                              qsl.data_ptr(), seqs, H, KVH, D, D ** -0.5, 0, out.data_ptr(),
                              H * D, D, 1, be.threads)
    return run


def product_case(be: CpuBackend, qtype, rows: int):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--flags", default="", help="added to kiln's build flags, e.g. -mno-avx512f")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    flags = args.flags.split()
    with tempfile.TemporaryDirectory() as tmp:
        bes = {name: backend(build(tree, flags, Path(tmp) / f"{name}.so"), (f"bench-{name}",))
               for name, tree in (("old", args.old), ("new", args.new))}
        cases: dict[str, dict[str, object]] = {}
        for seqs, ctx, ql in ATTENTION:
            cases[f"attention {seqs} x {ctx} ctx, {ql} q"] = {
                n: attention_case(be, seqs, ctx, ql) for n, be in bes.items()}
        for qtype, rows in PRODUCTS:
            cases[f"product {qtype.name} {rows} x {K} x {N}"] = {
                n: product_case(be, qtype, rows) for n, be in bes.items()}
        best = {(c, n): float("inf") for c in cases for n in bes}
        for r in range(args.rounds):
            for case, fns in cases.items():
                for n in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    best[case, n] = min(best[case, n], lower_quartile_ms(fns[n], args.reps))
    print(f"# {args.old} (old) against {args.new} (new), flags {flags or 'none'}")
    for case in cases:
        old, new = best[case, "old"], best[case, "new"]
        print(f"{case:36s} old {old:8.3f} ms  new {new:8.3f} ms  old/new {old / new:5.2f}x")


if __name__ == "__main__":
    main()
