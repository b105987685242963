"""A reply's `system_fingerprint`: what decides its bits, so that the same fingerprint, the
same request and the same seed give the same output (contract.md, "Responses").

It names the weights (their sha256), kiln's version, and the backend's numerics (device,
dtype and kernel variant: `EngineConfig.numerics`). On the CPU a reply's bits depend on
nothing else: not its batch, the thread count or the instruction set. OpenAI's shape:
"fp_" and ten hex digits.
"""

from __future__ import annotations

import hashlib
from importlib import metadata


def kiln_version() -> str:
    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def system_fingerprint(weights_sha256: str, numerics: str) -> str:
    key = f"weights {weights_sha256}\nkiln {kiln_version()}\n{numerics}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]
