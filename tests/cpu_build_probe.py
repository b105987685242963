"""What tests/test_cpu_builds.py compares between builds of kiln's C kernels. Run as

    python tests/cpu_build_probe.py OUT.pt [FLAG ...]

it builds the kernels with kiln's flags plus FLAG ... (a later -march overrides -march=native)
and saves, from that build: smollm2's logits at every position of a prompt and three greedy
steps after it (with 8-bit activations and an fp16 KV cache, and in fp32), the 8-bit
products of every quantized type, and the sampler's C kernels (top_p's threshold, the race,
the rows' statistics) on random logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paged import PagedSequence  # noqa: E402

from kiln.runtime.backends.cpu import library  # noqa: E402
from kiln.runtime.backends.cpu.backend import CpuBackend  # noqa: E402
from kiln.runtime.models import llama  # noqa: E402
from kiln.runtime.store.gguf_file import WeightSource, open_gguf  # noqa: E402
from kiln.runtime.store.pull import ensure_model  # noqa: E402

PROMPT = [1, 504, 3575, 282, 4649, 314, 7042, 30, 1073, 253, 1789, 2821, 28, 357, 6481, 29,
          4219, 30, 378, 2010, 314, 3575, 282, 4649, 1694, 28]  # 26 tokens: a block and a half


def logits(backend: CpuBackend) -> torch.Tensor:
    gf = open_gguf(str(ensure_model("smollm2:135m")))
    seq = PagedSequence(llama.build(llama.read_config(gf), gf, backend))
    out = [seq.feed(PROMPT, every_position=True)]
    for _ in range(3):
        out.append(seq.feed([int(out[-1][-1].argmax())], every_position=True))
    return torch.cat(out)


def products(flags: tuple[str, ...]) -> dict[str, torch.Tensor]:
    from test_cpu_kernels import QUANTIZED, _raw

    be = CpuBackend(extra_flags=flags, int8_products=True)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    return {f"product {q.name}": be.linear([WeightSource("w", q, 48, 512, _raw(q, 48, 512, 1))])(x)
            for q in QUANTIZED}


def sampler(flags: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The C kernels called as runtime/backends/cpu/race.py calls the native build's."""
    lib = library.load(flags)
    g = torch.Generator().manual_seed(4)
    R, V = 6, 49157  # a tail past the 16 lanes
    x = torch.randn(R, V, generator=g) * 3
    x[1, :40000] = float("-inf")
    m = x.max(-1).values
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.99, 0.6])
    thr = torch.empty(R)
    assert lib.kiln_top_p_threshold(x.data_ptr(), V, R, V, m.data_ptr(), top_p.data_ptr(),
                                    thr.data_ptr(), 2) == 0
    temp, min_p = torch.full((R,), 0.8), torch.full((R,), 0.01)
    seeds, steps = torch.arange(R) * 7919, torch.arange(R) + 3
    tokens = torch.empty(R, dtype=torch.int64)
    assert lib.kiln_race(x.data_ptr(), V, R, V, m.data_ptr(), thr.data_ptr(), temp.data_ptr(),
                         min_p.data_ptr(), seeds.data_ptr(), steps.data_ptr(),
                         tokens.data_ptr(), 2) == 0
    mx, log_sum, argmax = torch.empty(R), torch.empty(R), torch.empty(R, dtype=torch.int64)
    lib.kiln_row_stats(x.data_ptr(), V, R, V, mx.data_ptr(), argmax.data_ptr(),
                       log_sum.data_ptr(), 2)
    return {"top_p": thr, "race": tokens, "max": mx, "argmax": argmax, "log_sum": log_sum}


def main() -> None:
    out, flags = Path(sys.argv[1]), tuple(sys.argv[2:])
    np.random.seed(0)
    results = {"logits auto": logits(CpuBackend(extra_flags=flags, int8_products=True,
                                                kv_fp16=True)),
               "logits fp32": logits(CpuBackend(extra_flags=flags)),
               **products(flags), **sampler(flags)}
    torch.save(results, out)


if __name__ == "__main__":
    main()
