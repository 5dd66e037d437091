"""Rotary cos/sin from the CPU table against their direct computation (the reference)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specbatch.models.config import ModelConfig
from specbatch.models.rotary import RotaryEmbedding
from tests.helpers import tiny_config

CONFIGS = {
    "tiny": {},
    "smollm2": {"head_dim": 64, "rope_theta": 100000.0},
    "head_dim_80": {"head_dim": 80, "rope_theta": 500000.0},
    "llama3_scaled": {
        "head_dim": 64,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_are_the_direct_computation(name: str, dtype: torch.dtype) -> None:
    """A decode's one position, a verify's five, a prefill's 300, scattered positions past
    the table (it grows), a position computed again after growing: bit for bit the direct
    computation of the same positions."""
    overrides: dict[str, Any] = CONFIGS[name]
    rotary = RotaryEmbedding(ModelConfig.from_hf_dict(tiny_config(**overrides)))
    g = torch.Generator().manual_seed(0)
    steps = [
        torch.tensor([0]),
        torch.tensor([517]),
        torch.arange(40, 45),
        torch.arange(300),
        torch.randint(0, 5000, (64,), generator=g),  # past the first table: it grows
        torch.tensor([1023, 1024, 4999, 0]),
        torch.tensor([517]),
    ]
    for positions in steps:
        cos, sin = rotary.cos_sin(positions, dtype)
        want_cos, want_sin = rotary.compute(positions, dtype)
        assert cos.dtype == dtype
        assert cos.shape == want_cos.shape
        assert torch.equal(cos, want_cos)
        assert torch.equal(sin, want_sin)
    empty = rotary.cos_sin(torch.zeros(0, dtype=torch.long), dtype)
    assert empty[0].shape[0] == 0
