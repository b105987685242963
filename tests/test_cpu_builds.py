"""kiln's C kernels as the other hosts of our machine kind build them give this host's bits.

Each host builds the kernels with -march=native, so a host sees only its own compiler
output: gcc 12 miscompiled the top_p search for Sapphire Rapids alone (masked loads under
the wrong mask), which the AMD host could not have caught. Here every host also builds for
the others (and for an AVX2 laptop with AVX-VNNI) and compares what tests/cpu_build_probe.py
computes: smollm2's logits in both numerics, the 8-bit products of every quantized type, the
sampler's C kernels. A build this CPU cannot run (SIGILL) is skipped.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).with_name("cpu_build_probe.py")
HOSTS = {
    "sapphire-rapids": ("-march=sapphirerapids",),  # the Intel host
    # the AMD host (Zen 4) as gcc 12's -march=native reads it: znver3 plus AVX-512
    "zen4": ("-march=znver3", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq",
             "-mavx512cd", "-mavx512vbmi", "-mavx512ifma", "-mavx512vpopcntdq",
             "-mavx512vbmi2", "-mavx512vnni", "-mavx512bitalg", "-mavx512bf16", "-mgfni",
             "-mvaes", "-mvpclmulqdq"),
    "alder-lake": ("-march=alderlake",),  # a laptop: AVX2 and AVX-VNNI, no AVX-512
}


def probe(out: Path, flags: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), str(out), *flags], capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def native(tmp_path_factory, smollm2_gguf):
    out = tmp_path_factory.mktemp("native") / "native.pt"
    res = probe(out, ())
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("host", list(HOSTS))
def test_the_other_hosts_builds_give_this_builds_bits(native, host, tmp_path):
    res = probe(tmp_path / "theirs.pt", HOSTS[host])
    if res.returncode == -signal.SIGILL:
        pytest.skip(f"this CPU cannot run the {host} build")
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = torch.load(tmp_path / "theirs.pt")
    assert theirs.keys() == native.keys()
    differ = [key for key in native if not torch.equal(theirs[key], native[key])]
    assert not differ, f"the {host} build differs in {differ}"
