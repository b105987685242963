"""RMSNorm, and the residual add fused with it: one kernel where a decode step had three to six
(cast to fp32, the norm's reductions and products, cast back, and the residual's add).

`add_rms_norm(h, delta, w)` is the pre-norm block's seam: the residual stream h takes the
sublayer's output (h += delta, rounded to h's dtype as torch's add rounds it) and the next
sublayer's input is rms_norm(h) * w. Gemma's sandwich norms normalise the sublayer's output
before the add (`delta_weight`): still one kernel. Statistics and products are fp32 whatever
the activations' dtype (Gemma's outgrow fp16), one row per program: a row's bits never
depend on how many rows the launch has.
"""

import torch
import triton
import triton.language as tl

from kiln.kernels import INTERPRET

# A program per row on a GPU (a row is thousands of values); the interpreter runs programs one
# after another: many rows each there.
ROWS_PER_PROGRAM = 32 if INTERPRET else 1


# The token count changes with the batch: not specialised on (kernels/warmup.py).
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,  # [T, heads, n]: a token's heads x_head_stride apart (heads = 1 for a plain row)
    delta_ptr,  # [T, n] (HAS_DELTA): added to x in place before the norm
    delta_weight_ptr,  # [n] fp32 (DELTA_NORM): delta is normalised with it before the add
    weight_ptr,  # [n] fp32
    out_ptr,  # [T, heads, n]
    num_rows,  # T * heads
    heads,
    n,
    eps,
    x_token_stride,
    x_head_stride,
    delta_stride,
    out_token_stride,
    out_head_stride,
    HAS_DELTA: tl.constexpr,
    DELTA_NORM: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program: 1 on a GPU, more in the interpreter
    BLOCK_N: tl.constexpr,  # n padded to a power of 2
):
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    token, head = offs_r // heads, offs_r % heads
    mask = (offs_r < num_rows)[:, None] & (offs_n < n)[None, :]  # [BLOCK_R, BLOCK_N]
    x_offs = (token * x_token_stride + head * x_head_stride)[:, None] + offs_n[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + (token * delta_stride)[:, None] + offs_n[None, :],
                        mask=mask, other=0.0).to(tl.float32)
        if DELTA_NORM:
            delta_w = tl.load(delta_weight_ptr + offs_n, mask=offs_n < n, other=0.0)
            delta_r = tl.rsqrt(tl.sum(delta * delta, axis=1) / n + eps)  # [BLOCK_R]
            # rounded as the separate norm's output was, before the add reads it
            delta = (delta * delta_r[:, None] * delta_w[None, :]).to(x.dtype).to(tl.float32)
        x = (x.to(tl.float32) + delta).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + x_offs, x, mask=mask)
    xf = x.to(tl.float32)
    w = tl.load(weight_ptr + offs_n, mask=offs_n < n, other=0.0)
    r = tl.rsqrt(tl.sum(xf * xf, axis=1) / n + eps)  # [BLOCK_R]
    out = xf * r[:, None] * w[None, :]
    out_offs = (token * out_token_stride + head * out_head_stride)[:, None] + offs_n[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, delta, delta_weight, weight: torch.Tensor, out: torch.Tensor,
            eps: float) -> None:
    T, heads, n = x.shape
    assert x.stride(2) == 1 and out.stride(2) == 1 and weight.shape == (n,)
    assert weight.dtype == torch.float32
    rows = T * heads
    if rows == 0:
        return
    block_r = ROWS_PER_PROGRAM
    _rms_norm_kernel[(triton.cdiv(rows, block_r),)](
        x, delta if delta is not None else x, delta_weight if delta_weight is not None else
        weight, weight, out, rows, heads, n, eps, x.stride(0), x.stride(1),
        delta.stride(0) if delta is not None else 0, out.stride(0), out.stride(1),
        HAS_DELTA=delta is not None, DELTA_NORM=delta_weight is not None,
        BLOCK_R=block_r, BLOCK_N=triton.next_power_of_2(n))


def rms_norm(
    x: torch.Tensor,  # [T, n], rows contiguous
    weight: torch.Tensor,  # [n] fp32
    eps: float,
) -> torch.Tensor:  # [T, n], x's dtype
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x.unsqueeze(1), None, None, weight, out.unsqueeze(1), eps)
    return out


def rms_norm_heads_(
    x: torch.Tensor,  # [T, heads, head_dim] view, values contiguous: normalised in place
    weight: torch.Tensor,  # [head_dim] fp32
    eps: float,
) -> None:
    _launch(x, None, None, weight, x, eps)


def add_rms_norm(
    h: torch.Tensor,  # [T, n], rows contiguous: the residual stream, updated in place
    delta: torch.Tensor,  # [T, n], rows contiguous: the sublayer's output
    weight: torch.Tensor,  # [n] fp32
    eps: float,
    delta_weight: torch.Tensor | None = None,  # [n] fp32: Gemma's norm of delta before the add
) -> torch.Tensor:  # [T, n]: rms_norm(h + delta) * weight
    assert delta.shape == h.shape and delta.dtype == h.dtype and delta.stride(1) == 1
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    _launch(h.unsqueeze(1), delta, delta_weight, weight, out.unsqueeze(1), eps)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm in fp32, cast back to x's dtype."""
    return torch.nn.functional.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def rms_norm_heads_ref_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    x.copy_(rms_norm_ref(x, weight, eps))


def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                     delta_weight: torch.Tensor | None = None) -> torch.Tensor:
    if delta_weight is not None:
        delta = rms_norm_ref(delta, delta_weight, eps)
    h.add_(delta)
    return rms_norm_ref(h, weight, eps)
