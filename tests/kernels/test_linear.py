"""Packed linear layers (oneDNN's layout for both dtypes, MKL's for float32) against the plain
float32 product, for the row counts of decoding, verifying and prefilling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specbatch.kernels import amx_linear, sgemm
from specbatch.kernels.amx_linear import TileWeight
from specbatch.kernels.linear import Linear
from specbatch.kernels.onednn import (
    PADDED_ROWS,
    OneDnnWeight,
    cpu_packing_supported,
    measure_row_padding,
    packed_linear,
    padding_table,
)
from specbatch.kernels.sgemm import SgemmWeight

LAYOUTS = [
    (torch.float32, "onednn"),
    (torch.bfloat16, "onednn"),
    (torch.float32, "sgemm"),
    (torch.bfloat16, "tiles"),
]


def _pack(layer: Linear, layout: str) -> None:
    """``layer`` packed in ``layout`` (``Linear.pack`` picks MKL's for float32 and AMX tiles for
    bfloat16 where it can)."""
    if layout in ("sgemm", "tiles"):
        if not (sgemm.available() if layout == "sgemm" else amx_linear.available()):
            pytest.skip(f"no {layout} layout on this machine")
        layer.pack()
        assert isinstance(layer.form, SgemmWeight if layout == "sgemm" else TileWeight)
        return
    assert layer.weight is not None
    if not cpu_packing_supported(layer.weight.dtype):
        pytest.skip(f"oneDNN cannot pack {layer.weight.dtype} here")
    layer.use_form(OneDnnWeight.from_dense(layer.weight.detach()))


@pytest.mark.parametrize(("dtype", "layout"), LAYOUTS)
@pytest.mark.parametrize("rows", [0, 1, 5, 16, 64, 333])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_the_plain_product(
    dtype: torch.dtype, layout: str, rows: int, bias: bool
) -> None:
    generator = torch.Generator().manual_seed(rows)
    layer = Linear(96, 200, bias=bias)
    with torch.no_grad():
        assert layer.weight is not None
        layer.weight.copy_(torch.randn(200, 96, generator=generator))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(200, generator=generator))
    layer = layer.to(dtype)
    assert layer.weight is not None
    weight = layer.weight.detach().float()
    bias_values = None if layer.bias is None else layer.bias.detach().float()
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    expected = F.linear(x.float(), weight, bias_values)  # float32 products of the same values
    _pack(layer, layout)
    assert layer.weight is None
    got = layer(x)
    assert got.dtype == dtype
    assert got.shape == (rows, 200)
    # float32: summation order only; bfloat16: the output rounded to 8 mantissa bits
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance * 10)


def test_half_precision_is_not_packed() -> None:
    assert not cpu_packing_supported(torch.float16)


@pytest.mark.parametrize(("dtype", "layout"), LAYOUTS)
def test_a_row_has_the_same_bits_whatever_the_row_count(dtype: torch.dtype, layout: str) -> None:
    """oneDNN's single-row path sums in another order (seen at K = 1536, SmolLM2's down
    projection): one row is computed as two, so a row's result never depends on its batch.
    MKL's packed GEMM needs no such care (and gets none)."""
    generator = torch.Generator().manual_seed(0)
    layer = Linear(1536, 576)
    with torch.no_grad():
        assert layer.weight is not None
        layer.weight.copy_(torch.randn(576, 1536, generator=generator) * 0.05)
    layer = layer.to(dtype)
    _pack(layer, layout)
    x = torch.randn(40, 1536, generator=generator).to(dtype)
    full = layer(x)
    for rows in (1, 2, 3, 7, 16, 39):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows


def test_the_padding_table_takes_the_cheapest_count_with_the_same_bits() -> None:
    """Costs as measured on an AMD EPYC host (a sweep of SmolLM2's linears, ms): 4-5 rows
    cost less than 2-3; a count is skipped where its bits differ, and a gain under 10% is not
    worth the padding."""
    cost = {2: 22.4, 3: 18.9, 4: 18.0, 5: 17.9, 6: 19.8, 7: 20.0, 8: 20.3}
    same = dict.fromkeys(cost, True)
    assert padding_table(cost, same) == (0, 5, 5, 3, 4, 5, 6, 7, 8)  # 3 -> 5: under 10%
    same[5] = False  # 5 rows would change a row's bits: the next cheapest
    assert padding_table(cost, same) == (0, 4, 4, 3, 4, 5, 6, 7, 8)
    flat = {m: 10.0 + 0.1 * m for m in cost}  # monotonic, as on most CPUs: no padding
    assert padding_table(flat, same) == (0, 2, 2, 3, 4, 5, 6, 7, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_products_equal_unpadded_ones_bit_for_bit(dtype: torch.dtype) -> None:
    """Whatever table a model measures, padding never changes what a row computes."""
    if not cpu_packing_supported(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    generator = torch.Generator().manual_seed(3)
    layers = [Linear(96, 200), Linear(200, 96)]
    for layer in layers:
        with torch.no_grad():
            assert layer.weight is not None
            layer.weight.copy_(
                torch.randn(layer.out_features, layer.in_features, generator=generator)
            )
        layer.to(dtype)
        _pack(layer, "onednn")
    with torch.no_grad():
        table = measure_row_padding(
            [x.forward for x in layers], [x.in_features for x in layers], dtype
        )
    assert len(table) == PADDED_ROWS + 1
    assert all(max(m, 2) <= table[m] <= PADDED_ROWS for m in range(1, PADDED_ROWS + 1))
    x = torch.randn(PADDED_ROWS, 96, generator=generator).to(dtype)
    for layer in layers[:1]:
        for forced in range(2, PADDED_ROWS + 1):  # every count a table could hold
            padding = (0, *[max(m, forced) for m in range(1, PADDED_ROWS + 1)])
            for m in range(1, PADDED_ROWS + 1):
                assert isinstance(layer.form, OneDnnWeight)
                plain = packed_linear(x[:m], layer.form.packed, None, 200)
                padded = packed_linear(x[:m], layer.form.packed, None, 200, padding)
                assert torch.equal(plain, padded)
