"""The decode step's fused layer kernels against their torch references: RMSNorm and the
residual add fused with it (with Gemma's norm of the sublayer's output), the gated activation
(QK-norm + RoPE + the KV store: test_kv_cache_kernel.py). In the interpreter on CPU tensors,
compiled on CUDA."""

import math

import pytest
import torch
from conftest import DEVICES

from kiln.kernels.activation import act_mul, act_mul_ref
from kiln.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_ref,
    rms_norm,
    rms_norm_heads_,
    rms_norm_heads_ref_,
    rms_norm_ref,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
pytestmark = pytest.mark.usefixtures("rows_per_program")


def tol(dtype):
    # one rounding to the activations' dtype apart at most (the kernels round once where
    # torch rounds after each op)
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 2e-2, "rtol": 2e-2}


def randn(*shape, dtype, device, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576, 640, 896])
def test_rms_norm_and_the_fused_add_match_the_reference(n, dtype, device):
    h = randn(13, n, dtype=dtype, device=device, scale=3.0)
    delta = randn(13, n, dtype=dtype, device=device, seed=1)
    w = randn(n, dtype=torch.float32, device=device, seed=2)
    torch.testing.assert_close(rms_norm(h, w, 1e-6), rms_norm_ref(h, w, 1e-6), **tol(dtype))
    for delta_weight in (None, randn(n, dtype=torch.float32, device=device, seed=3)):
        got_h, want_h = h.clone(), h.clone()
        got = add_rms_norm(got_h, delta, w, 1e-6, delta_weight)
        want = add_rms_norm_ref(want_h, delta, w, 1e-6, delta_weight)
        torch.testing.assert_close(got_h, want_h, **tol(dtype))
        torch.testing.assert_close(got, want, **tol(dtype))
        # independently: the residual took the (normed) delta, the output is its RMSNorm
        d = delta.float() if delta_weight is None else \
            delta.float() * torch.rsqrt(delta.float().pow(2).mean(-1, keepdim=True) + 1e-6) \
            * delta_weight
        torch.testing.assert_close(got_h.float(), h.float() + d, **tol(dtype))
    if dtype == torch.float32:  # one add, rounded as torch's: the residual is exact
        got_h = h.clone()
        add_rms_norm(got_h, delta, w, 1e-6)
        assert torch.equal(got_h, h + delta)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_norm_has_the_same_bits_alone_and_in_a_batch(dtype, device):
    # batch invariance (README, "On a GPU"): one row per program, never a split reduction
    h = randn(37, 896, dtype=dtype, device=device, scale=3.0)
    delta = randn(37, 896, dtype=dtype, device=device, seed=1)
    w = randn(896, dtype=torch.float32, device=device, seed=2)
    full, fused = rms_norm(h, w, 1e-6), add_rms_norm(h.clone(), delta, w, 1e-6, w)
    for i in (0, 20, 36):
        assert torch.equal(rms_norm(h[i:i + 1], w, 1e-6), full[i:i + 1])
        assert torch.equal(add_rms_norm(h[i:i + 1].clone(), delta[i:i + 1], w, 1e-6, w),
                           fused[i:i + 1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_each_head_in_place_on_a_strided_view(dtype, device):
    qkv = randn(9, 3 + 2 * 1, 128, dtype=dtype, device=device)
    w = randn(128, dtype=torch.float32, device=device, seed=4)
    got, want = qkv.clone(), qkv.clone()
    rms_norm_heads_(got[:, :3], w, 1e-6)
    rms_norm_heads_ref_(want[:, :3], w, 1e-6)
    torch.testing.assert_close(got, want, **tol(dtype))
    assert torch.equal(got[:, 3:], qkv[:, 3:])  # the rest of the product untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("F", [64, 1536, 2048 + 5])
def test_gated_activation_matches_the_reference(F, activation, dtype, device):
    gate_up = randn(7, 2 * F, dtype=dtype, device=device, scale=2.0)
    got = act_mul(gate_up, activation)
    torch.testing.assert_close(got, act_mul_ref(gate_up, activation), **tol(dtype))
    g, u = gate_up.double().chunk(2, dim=-1)  # independently, in float64
    want = g / (1 + torch.exp(-g)) if activation == "silu" else \
        0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    torch.testing.assert_close(got.double(), want * u, **tol(dtype))
