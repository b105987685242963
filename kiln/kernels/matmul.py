"""The products of a batch-invariant forward: y = x @ w.T (+ bias), each output element reduced
in one order whatever the batch.

cuBLAS picks its kernel (tile shape, split-K) by the number of rows, so on CUDA a row's
logits follow how many other rows its step has. Here the tiles are fixed per dtype and never
depend on M, there is no split-K, and every tile walks K from 0 upwards in BLOCK_K steps with
one fp32 accumulator: an output element's sum is the same sequence of tensor-core (or, for
fp32, IEEE) dots alone or beside 255 other rows, at any place in its tile (vLLM's
VLLM_BATCH_INVARIANT and SGLang's deterministic mode do the same with a persistent matmul).
The bias is added in fp32 and the result rounded once to x's dtype.
"""

import torch
import triton
import triton.language as tl

from kiln.kernels import INTERPRET


# The rows change with the batch: not specialised on (kernels/warmup.py).
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,  # [M, K], rows x_stride apart
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    x_stride,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dots (torch's default), not TF32
    UPCAST: tl.constexpr,  # the interpreter's dots take no 16-bit floats: fp32 of the same
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # row tiles walked together, so their programs share w in L2
):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    in_m, in_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * x_stride + (k0 + offs_k)[None, :],
                    mask=in_m[:, None] & in_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :] * K + (k0 + offs_k)[:, None],
                    mask=in_k[:, None] & in_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:  # products of 16-bit floats are exact in fp32, as a tensor core's are
            x, w = x.to(tl.float32), w.to(tl.float32)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per input dtype: one configuration for every M,
# which is what makes the bits batch-invariant. The interpreter runs programs one after
# another in numpy: wide tiles there (the same rule, fewer programs).
TILES = {torch.bfloat16: (64, 64, 64, 4, 3), torch.float16: (64, 64, 64, 4, 3),
         torch.float32: (32, 64, 32, 4, 3)}
INTERPRET_TILES = (64, 1024, 128, 1, 1)
GROUP_M = 8


def matmul(
    x: torch.Tensor,  # [M, K], rows contiguous
    weight: torch.Tensor,  # [N, K] contiguous, x's dtype
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x's dtype
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape == (N, K) and weight.is_contiguous() and x.stride(1) == 1
    assert weight.dtype == x.dtype
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    bm, bn, bk, warps, stages = INTERPRET_TILES if INTERPRET else TILES[x.dtype]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        UPCAST=INTERPRET and x.dtype != torch.float32, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    return y


def matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """In fp32 (fp64 sums would be closer still), rounded once to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
