"""bfloat16 products on AMX tiles (``kernels.amx_linear``) against float64 products of the same
values, and the property the engine leans on: a row's bits do not depend on the rows beside it,
their number, the input's memory offset or the thread count."""

from __future__ import annotations

import pytest
import torch

from specbatch.kernels import amx_linear
from specbatch.kernels.amx_linear import TileWeight

pytestmark = pytest.mark.skipif(not amx_linear.available(), reason="no AMX tiles on this CPU")

SHAPES = [(1, 32), (7, 64), (200, 96), (960, 576), (576, 1536), (3072, 576), (130, 160)]


def _bf16(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_products_match_float64_within_a_bfloat16_rounding(n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(n * 31 + k)
    weight = _bf16((n, k), generator)
    tiles = TileWeight.from_dense(weight)
    assert (tiles.out_features, tiles.in_features) == (n, k)
    for rows in (0, 1, 2, 5, 17, 64):
        x = _bf16((rows, k), generator)
        got = amx_linear.amx_linear(x, tiles)
        assert got.shape == (rows, n)
        assert got.dtype == torch.bfloat16
        exact = x.double() @ weight.double().T
        # float32 sums of exact products (the 16-bit operands' products are exact), then one
        # rounding to bfloat16: half a bfloat16 ulp of the result, plus the float32 sums' error
        bound = exact.abs() * 2.0**-8 + 1e-6 * k * (x.double().abs() @ weight.double().abs().T)
        assert ((got.double() - exact).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize(("n", "k"), [(200, 96), (576, 1536), (3072, 576), (130, 160)])
def test_a_rows_bits_do_not_depend_on_its_batch(n: int, k: int) -> None:
    """Row counts 1 .. 699 (decodes, verifies, prefill chunks; full and partial 16-row and
    32-row blocks), any starting row, unaligned input, 1 and 2 threads."""
    generator = torch.Generator().manual_seed(k)
    tiles = TileWeight.from_dense(_bf16((n, k), generator))
    x = _bf16((700, k), generator)
    full = amx_linear.amx_linear(x, tiles)
    for rows in (1, 2, 3, 15, 16, 17, 31, 32, 33, 48, 64, 100, 255, 256, 257, 699):
        start = int(torch.randint(0, 700 - rows + 1, (1,), generator=generator))
        got = amx_linear.amx_linear(x[start : start + rows], tiles)
        assert torch.equal(got, full[start:][:rows]), rows
    unaligned = torch.empty(5 * k + 3, dtype=torch.bfloat16)[3:].view(5, k)
    unaligned.copy_(x[10:15])
    assert torch.equal(amx_linear.amx_linear(unaligned, tiles), full[10:15])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = amx_linear.amx_linear(x[:40], tiles)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, full[:40])


def test_bad_inputs_are_named() -> None:
    tiles = TileWeight.from_dense(torch.ones(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 rows of 32"):
        amx_linear.amx_linear(torch.ones(2, 5, dtype=torch.bfloat16), tiles)
    with pytest.raises(ValueError, match="bfloat16 rows of 32"):
        amx_linear.amx_linear(torch.ones(2, 32), tiles)
    with pytest.raises(ValueError, match="multiple of 32"):
        TileWeight.from_dense(torch.ones(4, 33, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 32"):
        TileWeight.from_dense(torch.ones(4, 32))
    assert not TileWeight.fits(torch.ones(4, 33, dtype=torch.bfloat16))
    assert amx_linear.amx_linear(torch.ones(2, 1, 32, dtype=torch.bfloat16), tiles).shape == (
        2,
        1,
        4,
    )
    assert tiles.nbytes == tiles.data.numel() * 2 > 0
