"""oneDNN-packed linear layers against the plain float32 product, for both packed dtypes and
the row counts of decoding, verifying and prefilling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specbatch.kernels.linear import Linear, cpu_packing_supported


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 16, 64, 333])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_the_plain_product(dtype: torch.dtype, rows: int, bias: bool) -> None:
    if not cpu_packing_supported(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
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
    layer.pack()
    assert layer.weight is None
    got = layer(x)
    assert got.dtype == dtype
    assert got.shape == (rows, 200)
    # float32: summation order only; bfloat16: the output rounded to 8 mantissa bits
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance * 10)


def test_half_precision_is_not_packed() -> None:
    assert not cpu_packing_supported(torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_whatever_the_row_count(dtype: torch.dtype) -> None:
    """oneDNN's single-row path sums in another order (seen at K = 1536, SmolLM2's down
    projection): one row is computed as two, so a row's result never depends on its batch."""
    if not cpu_packing_supported(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    generator = torch.Generator().manual_seed(0)
    layer = Linear(1536, 576)
    with torch.no_grad():
        assert layer.weight is not None
        layer.weight.copy_(torch.randn(576, 1536, generator=generator) * 0.05)
    layer = layer.to(dtype)
    layer.pack()
    x = torch.randn(40, 1536, generator=generator).to(dtype)
    full = layer(x)
    for rows in (1, 2, 3, 7, 16, 39):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
