"""The gated MLP's activation in one kernel: act(gate) * up from the stacked gate_up product
(SiLU for llama, qwen and phi3; GELU's tanh form for Gemma), in fp32, rounded once. torch
took two kernels and rounded twice (the activation's output, then the product)."""

import torch
import triton
import triton.language as tl

from kiln.kernels import INTERPRET

ACTIVATIONS = ("silu", "gelu_tanh")
BLOCK_F = 1024  # values of a row per program
# A program per token on a GPU; the interpreter runs programs one after another: many there,
# and whole rows.
TOKENS_PER_PROGRAM = 16 if INTERPRET else 1


# The token count changes with the batch: not specialised on (kernels/warmup.py).
@triton.jit(do_not_specialize=["T"])
def _act_mul_kernel(
    gate_up_ptr,  # [T, 2F]: gate, then up
    out_ptr,  # [T, F]
    T,
    F,
    gate_up_stride,
    out_stride,
    GELU: tl.constexpr,  # GELU (tanh) instead of SiLU
    BLOCK_T: tl.constexpr,  # tokens per program: 1 on a GPU, more in the interpreter
    BLOCK_F: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # [BLOCK_F]
    mask = (token < T)[:, None] & (offs < F)[None, :]
    at = (token * gate_up_stride)[:, None] + offs[None, :]
    g = tl.load(gate_up_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + F + at, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # tanh(y) = 2 sigmoid(2y) - 1
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 * tl.sigmoid(2.0 * y))
    else:
        act = g * tl.sigmoid(g)
    tl.store(out_ptr + (token * out_stride)[:, None] + offs[None, :],
             (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def act_mul(
    gate_up: torch.Tensor,  # [T, 2F], rows contiguous
    activation: str,  # one of ACTIVATIONS
) -> torch.Tensor:  # [T, F]
    T, F2 = gate_up.shape
    assert activation in ACTIVATIONS, activation
    assert gate_up.stride(1) == 1 and F2 % 2 == 0
    F = F2 // 2
    out = torch.empty((T, F), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block_f = triton.next_power_of_2(F) if INTERPRET else BLOCK_F
    block_t = TOKENS_PER_PROGRAM
    _act_mul_kernel[(triton.cdiv(T, block_t), triton.cdiv(F, block_f))](
        gate_up, out, T, F, gate_up.stride(0), out.stride(0), GELU=activation == "gelu_tanh",
        BLOCK_T=block_t, BLOCK_F=block_f)
    return out


def act_mul_ref(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return torch.nn.functional.silu(gate).mul_(up)
    return torch.nn.functional.gelu(gate, approximate="tanh").mul_(up)
