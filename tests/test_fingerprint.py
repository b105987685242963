"""system_fingerprint names what decides a reply's bits (contract.md, "Responses"): the
weights' sha256, kiln's version and the backend's numerics. Each changes it; nothing else
does. (Every reply carrying it: test_api_streaming.py.)"""

import hashlib
import re

import pytest
import torch

from kiln.runtime.backends.cpu.backend import CpuBackend
from kiln.runtime.backends.dense import DenseBackend
from kiln.runtime.engine.bootstrap import EngineOptions, build_engine
from kiln.runtime.engine.fingerprint import system_fingerprint
from kiln.runtime.store.catalogue import lookup
from kiln.runtime.store.weights_digest import weights_sha256


def test_the_fingerprint_changes_with_the_weights_and_the_numerics_alone():
    fp = system_fingerprint("ab" * 32, "cpu kernels: products fp32, KV cache fp32")
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fp)
    assert fp == system_fingerprint("ab" * 32, "cpu kernels: products fp32, KV cache fp32")
    assert fp != system_fingerprint("cd" * 32, "cpu kernels: products fp32, KV cache fp32")
    assert fp != system_fingerprint("ab" * 32, "cpu kernels: products fp32, KV cache fp16")


def test_each_cpu_kernel_variant_has_its_own_numerics():
    variants = [CpuBackend(), CpuBackend(kv_fp16=True), CpuBackend(int8_products=True),
                CpuBackend(int8_products=True, kv_fp16=True)]
    assert len({b.numerics for b in variants}) == 4
    # the thread count decides no bit: it is not named
    assert CpuBackend(threads=1).numerics == CpuBackend(threads=3).numerics


def test_the_gpu_paths_products_are_named():
    # cuBLAS's products follow the batch, the batch-invariant ones do not: not the same bits
    invariant = DenseBackend("cpu", torch.bfloat16, use_triton=True, batch_invariant=True)
    plain = DenseBackend("cpu", torch.bfloat16, use_triton=True)
    assert invariant.numerics.endswith(", batch-invariant products")
    assert plain.numerics != invariant.numerics
    assert "attention tiles of 16 rows" in plain.numerics  # a GPU's bits follow the height
    assert DenseBackend("cpu", torch.float16, use_triton=True, batch_invariant=True).numerics \
        != invariant.numerics
    with pytest.raises(ValueError, match="use_triton"):
        DenseBackend("cpu", batch_invariant=True)


def test_the_engine_config_carries_the_dtypes_numerics():
    auto = build_engine("smollm2:135m", EngineOptions(ctx_len=512))[1].config.numerics
    fp32 = build_engine("smollm2:135m", EngineOptions(ctx_len=512, dtype="float32")
                        )[1].config.numerics
    assert auto == "cpu kernels: products 8-bit activations, KV cache fp16"
    assert fp32 == "cpu kernels: products fp32, KV cache fp32"


def test_weights_are_named_by_their_sha256(smollm2_gguf, tmp_path):
    entry = lookup("smollm2:135m")
    assert weights_sha256(smollm2_gguf, entry) == entry.sha256
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 1000)
    assert weights_sha256(f, None) == hashlib.sha256(f.read_bytes()).hexdigest()
    f.write_bytes(b"GGUF" + bytes(1000))  # a file changed in place is read again
    assert weights_sha256(f, None) == hashlib.sha256(f.read_bytes()).hexdigest()


def test_serve_takes_no_batch_invariant():
    from kiln.api.cli import build_parser, engine_options

    parser = build_parser()
    assert engine_options(parser.parse_args(["serve", "smollm2:135m"])).batch_invariant
    assert not engine_options(parser.parse_args(
        ["serve", "smollm2:135m", "--no-batch-invariant"])).batch_invariant
