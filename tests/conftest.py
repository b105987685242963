"""Shared fixtures. Without CUDA, Triton kernels run in the interpreter on CPU tensors."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined (i.e. before kernels/ is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path to the default model's GGUF, pulled into the model cache on first use."""
    from runtime.pull import ensure_model

    return str(ensure_model("smollm2:135m"))
