"""The C layer operations (``kernels/cpu_ops``) against torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specbatch.kernels import cpu_ops


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu_ops.load_library() is not None  # a silent fallback would test torch twice


@pytest.mark.parametrize(("rows", "dim"), [(0, 576), (1, 576), (3, 64), (40, 1536), (5, 100)])
def test_rms_norm_matches_torch(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=gen) * 3
    weight = torch.randn(dim, generator=gen)
    got = cpu_ops.rms_norm(x, weight, 1e-5)
    assert got is not None
    expected = F.rms_norm(x.double(), (dim,), weight.double(), 1e-5).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_rows_are_independent_of_the_batch_and_stride() -> None:
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(33, 900, generator=gen)
    x = wide[:, :576]  # strided rows
    weight = torch.randn(576, generator=gen)
    together = cpu_ops.rms_norm(x, weight, 1e-6)
    assert together is not None
    for r in (0, 17, 32):
        alone = cpu_ops.rms_norm(x[r : r + 1].contiguous(), weight, 1e-6)
        assert alone is not None
        assert torch.equal(alone, together[r : r + 1])


def test_rms_norm_declines_what_it_does_not_handle() -> None:
    weight = torch.ones(8)
    assert cpu_ops.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), weight, 1e-5) is None
    assert cpu_ops.rms_norm(torch.ones(2, 4, 8), weight, 1e-5) is None
    assert cpu_ops.rms_norm(torch.ones(8, 2).T, weight, 1e-5) is None  # columns strided
