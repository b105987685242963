"""kiln's CPU kernels (csrc/*.c): built on first use with the machine's C compiler, loaded
with ctypes.

The build is keyed by the sources, the compiler's version, the CPU's flags and the build
flags, and lands in kiln's home (~/.cache/kiln/ext), so a second process or a second run
loads it at once. `-ffp-contract=off` keeps the compiler from fusing a multiply and an add on
its own: every fma in the kernels is written out, which is what makes their order of
operations the same on AVX-512 and AVX2 builds (csrc/simd.h).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger("kiln")

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-pthread", "-shared", "-fPIC")

_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "kiln_group_bytes": ([_INT, _I], _I),
    "kiln_dequant": ([_INT, _P, _I, _I, _P], None),
    "kiln_embed": ([_INT, _P, _I, _P, _I, _P, _INT], None),
    "kiln_linear": ([_P, _I, _I, _I, _P, _I, _P, _P, _I, _INT], None),
    "kiln_linear_i8": ([_P, _I, _I, _I, _P, _I, _P, _P, _I, _INT], _INT),
    "kiln_i8_type": ([_INT], _INT),
    "kiln_rms_norm": ([_P, _I, _I, _I, _I, _I, _P, _F, _P, _I, _I, _INT], None),
    "kiln_rope": ([_P, _I, _I, _I, _I, _I, _P, _P, _P, _INT], None),
    "kiln_act_mul": ([_P, _I, _I, _I, _INT, _P, _I, _INT], None),
    "kiln_attention": ([_P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _F, _I, _P, _I, _I,
                        _INT, _INT], None),
    "kiln_store_kv": ([_P, _I, _P, _I, _P, _I, _I, _I, _P, _P, _INT], None),
    "kiln_philox_uniform": ([_P, _P, _P, _I, _P, _INT], None),
    "kiln_race": ([_P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _INT], _INT),
    "kiln_top_p_threshold": ([_P, _I, _I, _I, _P, _P, _P, _INT], _INT),
    "kiln_row_stats": ([_P, _I, _I, _I, _P, _P, _P, _INT], None),
}


class Part(ctypes.Structure):
    """csrc/linear.c's kiln_part: one GGUF tensor of a stacked weight."""

    _fields_ = [("type", _I), ("rows", _I), ("col0", _I), ("blocks", _P)]


class KernelBuildError(RuntimeError):
    """The kernels cannot be built or loaded here (no compiler, a CPU without AVX2)."""


_loaded: dict[tuple[str, ...], ctypes.CDLL] = {}
_errors: dict[tuple[str, ...], str] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(out: Path, flags: tuple[str, ...]) -> None:
    cc = os.environ.get("CC", "cc")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, *flags, "-o", str(tmp), *map(str, sorted(CSRC.glob("*.c")))]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise KernelBuildError(f"{cc}: {exc}") from exc
    if res.returncode != 0:
        raise KernelBuildError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-600:]}")
    tmp.replace(out)  # atomic: a second process building at once finds one whole file


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernels built with FLAGS + extra_flags (tests build an AVX2 variant with
    ("-mno-avx512f",)); raises KernelBuildError with the reason where they cannot be."""
    key = tuple(extra_flags)
    if key in _loaded:
        return _loaded[key]
    if key in _errors:
        raise KernelBuildError(_errors[key])
    from kiln.runtime.store.pull import kiln_home

    flags = FLAGS + key
    try:
        cc = os.environ.get("CC", "cc")
        try:
            version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        except OSError as exc:
            raise KernelBuildError(f"no C compiler ({cc}: {exc})") from exc
        h = hashlib.sha256(version.encode() + _cpu_flags().encode() + " ".join(flags).encode())
        for src in sorted(CSRC.iterdir()):
            h.update(src.name.encode() + src.read_bytes())
        out = kiln_home() / "ext" / f"kiln_cpu-{h.hexdigest()[:16]}.so"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            _build(out, flags)
        try:
            lib = ctypes.CDLL(str(out))
        except OSError as exc:
            raise KernelBuildError(f"cannot load {out}: {exc}") from exc
    except KernelBuildError as exc:
        _errors[key] = str(exc)
        raise
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _loaded[key] = lib
    return lib


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, or None if they can."""
    try:
        load()
    except KernelBuildError as exc:
        return str(exc)
    return None
