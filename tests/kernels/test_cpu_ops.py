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


def test_rotary_matches_torch() -> None:
    from specbatch.models.rotary import apply_rotary

    gen = torch.Generator().manual_seed(3)
    tokens, heads, dim = 5, 7, 64
    qkv = torch.randn(tokens, heads * dim + 40, generator=gen)  # extra columns stay untouched
    angles = torch.randn(tokens, dim // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :].contiguous()
    sin = torch.cat([-angles.sin(), angles.sin()], -1)[:, None, :].contiguous()
    expected = apply_rotary(qkv[:, : heads * dim].view(tokens, heads, dim), cos, sin)
    rotated = qkv.clone()
    assert cpu_ops.rotary_(rotated, heads, dim, cos, sin)
    torch.testing.assert_close(
        rotated[:, : heads * dim].view(tokens, heads, dim), expected, rtol=1e-6, atol=1e-6
    )
    assert torch.equal(rotated[:, heads * dim :], qkv[:, heads * dim :])
    assert not cpu_ops.rotary_(rotated.to(torch.bfloat16), heads, dim, cos, sin)


def test_silu_mul_matches_torch() -> None:
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(33, 2 * 96, generator=gen) * 4
    got = cpu_ops.glu_mul(gate_up, 96)
    assert got is not None
    gate, up = gate_up.double().split(96, dim=-1)
    expected = (F.silu(gate) * up).float()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert cpu_ops.glu_mul(gate_up.T, 16) is None  # not contiguous rows


def test_bfloat16_rows_follow_hf_llamas_arithmetic() -> None:
    """bfloat16 rows are computed in float32 and rounded where HF Llama rounds: the normalised
    row before the weight multiplies it, each rotary and SiLU-gate output once."""
    from specbatch.models.rotary import apply_rotary

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 576, generator=gen) * 2).to(torch.bfloat16)
    weight = torch.randn(576, generator=gen).to(torch.bfloat16)
    normed = F.rms_norm(x.float(), (576,), eps=1e-5).to(torch.bfloat16)
    got = cpu_ops.rms_norm(x, weight, 1e-5)
    assert got is not None
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, weight * normed, rtol=1e-2, atol=1e-2)

    qkv = torch.randn(3, 5 * 64, generator=gen).to(torch.bfloat16)
    angles = torch.randn(3, 32, generator=gen)
    cos = torch.cat([angles.cos()] * 2, -1)[:, None, :].to(torch.bfloat16).contiguous()
    sin = torch.cat([-angles.sin(), angles.sin()], -1)[:, None, :].to(torch.bfloat16).contiguous()
    expected = apply_rotary(qkv.float().view(3, 5, 64), cos.float(), sin.float())
    rotated = qkv.clone()
    assert cpu_ops.rotary_(rotated, 5, 64, cos, sin)
    torch.testing.assert_close(rotated.view(3, 5, 64).float(), expected, rtol=1e-2, atol=1e-2)

    gate_up = torch.randn(4, 2 * 96, generator=gen).to(torch.bfloat16)
    activation = cpu_ops.glu_mul(gate_up, 96)
    assert activation is not None
    gate, up = gate_up.float().split(96, dim=-1)
    torch.testing.assert_close(activation.float(), F.silu(gate) * up, rtol=1e-2, atol=1e-2)
