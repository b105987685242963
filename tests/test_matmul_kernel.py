"""The batch-invariant product (kernels/matmul.py) against its torch reference, and the
invariance itself: a row's bits alone, inside a batch of 37 and at another place in its tile
are the same. In the interpreter on CPU tensors (with its tiles and with a GPU's), compiled on
CUDA."""

import pytest
import torch
from conftest import DEVICES

from kiln.kernels import matmul as mm
from kiln.kernels.matmul import matmul, matmul_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["launcher", "gpu-tiles"])
def tiles(request, monkeypatch):
    """The launcher's tiles (wide in the interpreter), and a GPU's (what CUDA runs)."""
    if request.param == "gpu-tiles":
        monkeypatch.setattr(mm, "INTERPRET_TILES", (64, 64, 64, 1, 1))
    return request.param


def _inputs(M, N, K, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype=dtype, device=device)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype=dtype, device=device)
    b = torch.randn(N, generator=gen).to(dtype=dtype, device=device)
    return x, w, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 300, 200), (5, 64, 576), (37, 320, 130),
                                   (70, 1100, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_matches_its_reference(tiles, device, dtype, shape, with_bias):
    # ragged N and K tiles, a single row and a batch past one row tile
    M, N, K = shape
    x, w, b = _inputs(M, N, K, dtype, device)
    bias = b if with_bias else None
    y = matmul(x, w, bias)
    ref = matmul_ref(x.double(), w.double(), None if bias is None else bias.double())
    assert y.dtype == dtype and y.shape == (M, N)
    # one rounding to dtype apart (fp32: the sums' own rounding)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(y.double(), ref, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_its_batch(tiles, device, dtype):
    x, w, b = _inputs(37, 320, 200, dtype, device, seed=1)
    full = matmul(x, w, b)
    for i in (0, 5, 36):
        assert torch.equal(matmul(x[i:i + 1], w, b), full[i:i + 1]), f"row {i} alone"
    # rows 3..19: every row at another place in its tile than in the batch of 37
    assert torch.equal(matmul(x[3:20], w, b), full[3:20])
    # a row beside other values: its neighbours never reach it
    other = torch.randn_like(x.float()).to(dtype)
    other[7] = x[7]
    assert torch.equal(matmul(other, w, b)[7], full[7])


def test_a_strided_x_reads_its_rows():
    # the forward's x may be a view into a wider tensor (rows x_stride apart)
    x, w, b = _inputs(4, 96, 64, torch.float32, "cpu")
    wide = torch.zeros(4, 100)
    wide[:, 10:74] = x
    assert torch.equal(matmul(wide[:, 10:74], w, b), matmul(x, w, b))
