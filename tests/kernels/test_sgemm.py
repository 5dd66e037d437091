"""MKL's packed GEMM (``kernels.sgemm``) against float64 products, and the property the engine
leans on: a row's bits do not depend on the rows beside it, their number, the input's memory
offset or the thread count."""

from __future__ import annotations

import ctypes

import pytest
import torch

from specbatch.kernels import cpu_ops, sgemm
from specbatch.kernels.sgemm import SgemmWeight, sgemm_linear

pytestmark = pytest.mark.skipif(
    not sgemm.available(), reason="MKL's packed GEMM is not exported by this torch"
)

SHAPES = [(1, 1), (7, 3), (200, 96), (960, 576), (576, 1536), (3072, 576), (130, 37)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_products_match_float64(n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(n * 31 + k)
    weight = torch.randn(n, k, generator=generator)
    packed = SgemmWeight.from_dense(weight)
    assert (packed.out_features, packed.in_features) == (n, k)
    for rows in (0, 1, 2, 5, 64):
        x = torch.randn(rows, k, generator=generator)
        got = sgemm_linear(x, packed)
        assert got.shape == (rows, n)
        assert got.dtype == torch.float32
        expected = x.double() @ weight.double().T
        # float32 sums of k products: within a few ulps of the magnitude summed
        bound = 1e-6 * k * (x.double().abs() @ weight.double().abs().T) + 1e-30
        assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize(("n", "k"), [(200, 96), (576, 1536), (3072, 576), (130, 37)])
def test_a_rows_bits_do_not_depend_on_its_batch(n: int, k: int) -> None:
    """Every row count from 1 to 700 (decodes, verifies, prefill chunks), any starting row,
    unaligned input and output memory, 1 and 2 threads: each row's bits as in one product of
    all rows."""
    generator = torch.Generator().manual_seed(k)
    packed = SgemmWeight.from_dense(torch.randn(n, k, generator=generator))
    x = torch.randn(700, k, generator=generator)
    full = sgemm_linear(x, packed)
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, 31, 33, 64, 100, 255, 256, 257, 699):
        start = int(torch.randint(0, 700 - rows + 1, (1,), generator=generator))
        assert torch.equal(sgemm_linear(x[start : start + rows], packed), full[start:][:rows])
    unaligned = torch.empty(5 * k + 3)[3:].view(5, k)  # 12 bytes past torch's 64-byte line
    unaligned.copy_(x[10:15])
    assert torch.equal(sgemm_linear(unaligned, packed), full[10:15])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = sgemm_linear(x[:40], packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, full[:40])


def test_the_c_entry_point_gives_the_python_paths_bits() -> None:
    """``cpu_ops.sgemm_linear`` (what a fused layer calls) against ``sgemm_linear``, including
    an output that starts off a cache line, as a fused layer's scratch rows may."""
    library = cpu_ops.load_library()
    if library is None:
        pytest.skip("no C compiler")
    library.set_sgemm_compute(sgemm.compute_address())
    generator = torch.Generator().manual_seed(5)
    packed = SgemmWeight.from_dense(torch.randn(300, 64, generator=generator))
    for rows in (0, 1, 6, 41):
        x = torch.randn(rows, 64, generator=generator)
        out = torch.full((rows * 300 + 5,), float("nan"))[5:]
        status = library.sgemm_linear(
            0, ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(rows), ctypes.c_int64(64),
            ctypes.c_void_p(packed.data.data_ptr()), ctypes.c_int64(300),
            ctypes.c_void_p(out.data_ptr()), 2,
        )  # fmt: skip
        assert status == 0
        assert torch.equal(out.view(rows, 300), sgemm_linear(x, packed))


def test_bad_inputs_are_named() -> None:
    packed = SgemmWeight.from_dense(torch.ones(4, 3))
    with pytest.raises(ValueError, match="float32 rows of 3"):
        sgemm_linear(torch.ones(2, 5), packed)
    with pytest.raises(ValueError, match="float32 rows of 3"):
        sgemm_linear(torch.ones(2, 3, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="2-D float32 CPU matrix"):
        SgemmWeight.from_dense(torch.ones(4, 3, dtype=torch.bfloat16))
    assert sgemm_linear(torch.ones(2, 1, 3), packed).shape == (2, 1, 4)  # leading dims kept
    assert packed.nbytes == packed.data.numel() > 0
