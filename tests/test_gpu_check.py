"""bench/gpu_check.sh, the one script a GPU machine runs, works: its dry run (the same steps
at toy sizes, on the CPU in Triton's interpreter) passes every check it makes and prints
every section's figures. Its numbers here are not GPU figures and are not asserted."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_passes_every_check():
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in out, out
    for section in ("logits float32 invariant vs CPU reference", "logits float32 cuBLAS vs",
                    "attention batch", "decode grid bits equal", "tokens equal to sample_ref",
                    "vs filtered softmax",
                    "attention decode", "fused sampler", "product 37 x 200 x 128",
                    "a row's bits alone and in 37 rows, batch-invariant",
                    "replies alone vs cached, batch-invariant",
                    "decode step smollm2-135m batch 3 graphs invariant",
                    "batch 3 graphs invariant async",
                    "batch 3 graphs invariant sampler eager",
                    "mixed step smollm2-135m batch 3 + 1 x 16 graphs invariant pieces",
                    "batch 3 graphs cuBLAS", "batch 3 eager invariant",
                    "serving: greedy chat, whole vs streamed", "serving: SIGTERM",
                    "torch.compile decode step smollm2-135m batch 3",
                    "prefill attention smollm2-135m 2 x 48 rows=16 tiles=4",
                    "prefill attention smollm2-135m 2 x 48 rows=64 tiles=1",
                    "decode grid bits equal the general grid's, 64-row tiles", "total"):
        assert section in out, f"{section!r} missing:\n{out}"
    # logits (two products), two attention cases and the decode grid's bits at 16 and 64
    # rows, two sampler checks, two products' rows, four replies' comparisons, four serving
    # checks, the prefill tiles' bits
    assert out.count(" ok") == 19, out
