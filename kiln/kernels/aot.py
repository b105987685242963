"""Ahead-of-time compile of every kernel variant kiln launches, for a GPU it does not have.

    python -m kiln.kernels.aot [--arch 90 --arch 80] [--model smollm2:135m ...]

Runs the launchers of kernels/warmup.py on CPU tensors for each model's shapes and dtype,
with Triton's JIT pointed at a stand-in driver whose target is the given NVIDIA arch: Triton
specialises the launches exactly as it would on that GPU, and instead of launching, each new
variant is compiled for the target through `triton.compile` (ptxas ships in the wheel). One
line per variant: registers, shared memory, spill stores and loads (`ptxas -v`), how many
tiles its pipelined loads keep in shared memory (`buffers`) and its tensor-core instruction
(`wgmma`, Hopper's warpgroup MMA; `mma`, mma.sync; `-`: none). Exits 1 on
a compile error or shared memory over the arch's limit. Not under TRITON_INTERPRET: the
interpreter replaces the JIT.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime.driver import driver

from kiln.kernels.attention import TILE_ROWS
from kiln.kernels.warmup import KernelShapes, warmup_launches

# The catalogue's shapes plus a Llama-3.2-1B-class model (GQA 4, head_dim 64, 128k vocab).
SHAPES = {
    "smollm2:135m": KernelShapes(9, 3, 64, 49152, 576, 1536, 64),
    "gemma3:270m": KernelShapes(4, 1, 256, 262144, 640, 2048, 256, "gelu_tanh", qk_norm=True,
                                sandwich_norms=True, sliding_windows=(0, 512)),
    "qwen2.5-coder:0.5b": KernelShapes(14, 2, 64, 151936, 896, 4864, 64, qkv_bias=True),
    "llama-1b": KernelShapes(32, 8, 64, 128256, 2048, 8192, 64),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetDriver:
    """Just what the JIT asks of a driver before it compiles: the target, a device, a stream."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@dataclass
class Variant:
    kernel: str
    where: str  # the model / dtype / launch that first asked for it
    registers: int
    shared: int
    spill_stores: int
    spill_loads: int
    buffers: int  # tiles each pipelined load keeps in shared memory (1: nothing in flight)
    mma: str  # the tensor-core instruction: "wgmma", "mma" (mma.sync) or "-"
    seconds: float


def resource_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill stores, spill loads in bytes) from `ptxas -v`: the ptxas Triton
    itself uses for the arch (its wheel ships two)."""
    tool = get_ptxas(arch).path
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        text = subprocess.run([str(tool), "-v", f"--gpu-name={gpu}", "k.ptx", "-o", "k.cubin"],
                              cwd=d, check=True, capture_output=True, text=True).stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return regs, int(spills.group(1)), int(spills.group(2))


def pipeline_buffers(ttgir: str) -> int:
    """The deepest multi-buffered tile load: Triton's pipeliner allocates a load's shared
    memory as [buffers, *tile] (`ttg.local_alloc : () -> !ttg.memdesc<2x64x64xbf16...>`), so
    2 means one tile arrives while the previous one is used; 0 when no 2-D tile is
    pipelined."""
    depths = re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)
    return max(map(int, depths), default=0)


def mma_kind(ptx: str) -> str:
    """The tensor-core instruction the code's dots compile to."""
    return "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else "-"


# Shared memory a block may use (sm_90: 227 KB, sm_80: 163 KB); triton.compile does not check.
SHARED_LIMIT = {90: 232448, 80: 166912}


class Recorder:
    """Points Triton's JIT at `arch`; every launch of a variant not seen before is compiled
    for it (compile=True) or only recorded; nothing is launched."""

    def __init__(self, arch: int, compile: bool = True):
        self.arch, self.compile = arch, compile
        self.target = GPUTarget("cuda", arch, 32)
        self.keys: set[tuple[str, str]] = set()
        self.variants: list[Variant] = []
        self.errors: list[tuple[str, str, str]] = []
        self.where = ""

    def __enter__(self) -> Recorder:
        self._previous = driver._active  # reset_active() would look for a real GPU driver
        driver.set_active(TargetDriver(self.target))
        triton.knobs.runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        triton.knobs.runtime.jit_cache_hook = None
        driver._active = self._previous

    def _hook(self, key, fn, compile, **_) -> bool:
        jit = fn.jit_function
        ident = (jit.__qualname__, str(key))
        if ident in self.keys:
            return True
        self.keys.add(ident)
        if not self.compile:
            return True
        t0 = time.perf_counter()
        try:
            src = ASTSource(jit, compile["signature"], compile["constants"],
                            compile["configs"][0])
            options = {k: compile[k] for k in ("num_warps", "num_ctas", "num_stages",
                                               "enable_fp_fusion")}
            kernel = triton.compile(src, target=self.target, options=options)
            seconds = time.perf_counter() - t0
            regs, stores, loads = resource_usage(kernel.asm["ptx"], self.arch)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then exit 1
            self.errors.append((jit.__name__, self.where, f"{type(exc).__name__}: {exc}"))
            return True
        shared = kernel.metadata.shared
        if shared > SHARED_LIMIT[self.arch]:
            self.errors.append((jit.__name__, self.where, f"{shared} B of shared memory, "
                                f"over sm_{self.arch}'s {SHARED_LIMIT[self.arch]}"))
        self.variants.append(Variant(jit.__name__, self.where, regs, shared, stores, loads,
                                     pipeline_buffers(kernel.asm["ttgir"]),
                                     mma_kind(kernel.asm["ptx"]), seconds))
        return True  # handled here: the JIT neither compiles again nor launches

    def run(self, label: str, launches) -> None:
        for name, launch in launches:
            self.where = f"{label} {name}"
            launch()


def compile_all(arch: int, models: list[str], dtypes: list[str],
                attention_rows: int = TILE_ROWS) -> Recorder:
    with Recorder(arch) as rec:
        for model in models:
            for dtype in dtypes:
                dt = DTYPES[dtype]
                rec.run(f"{model} {dtype}", warmup_launches(
                    SHAPES[model], dt, dt, "cpu", attention_rows=attention_rows))
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, action="append", help="sm arch (default 90 and 80)")
    p.add_argument("--model", action="append", choices=sorted(SHAPES))
    p.add_argument("--dtype", action="append", choices=sorted(DTYPES))
    p.add_argument("--attention-rows", type=int, default=TILE_ROWS,
                   help="query rows of an attention tile (default: kiln's)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot: unset TRITON_INTERPRET (the interpreter replaces the JIT)", file=sys.stderr)
        return 2
    failed = False
    for arch in args.arch or [90, 80]:
        rec = compile_all(arch, args.model or list(SHAPES), args.dtype or list(DTYPES),
                          args.attention_rows)
        variants, errors = rec.variants, rec.errors
        for v in variants:
            print(f"sm_{arch} {v.kernel:26s} regs {v.registers:3d}  shared {v.shared:6d} B  "
                  f"spills {v.spill_stores:4d} B stored {v.spill_loads:4d} B loaded  "
                  f"buffers {v.buffers}  {v.mma:5s}  {v.seconds:4.1f} s  [{v.where}]")
        for kernel, where, message in errors:
            print(f"sm_{arch} {kernel} FAILED [{where}]: {message}")
        print(f"sm_{arch}: {len(variants)} variants compiled, {len(errors)} failed")
        failed |= bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
