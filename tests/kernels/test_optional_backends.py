"""flash-attn and xformers backends against the reference (skipped without CUDA builds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.errors import ConfigError
from specbatch.kernels.attention import attention_backend_class
from specbatch.kernels.attention.optional_backends import (
    flash_attn_available,
    xformers_available,
)
from tests.kernels.reference_attention import float32_reference, random_step

BACKENDS = [
    pytest.param(
        "flash_attn",
        256,
        marks=pytest.mark.skipif(
            not flash_attn_available(), reason="flash-attn with CUDA is not installed"
        ),
    ),
    pytest.param(
        "xformers",
        16,
        marks=pytest.mark.skipif(
            not xformers_available(), reason="xformers with CUDA kernels is not installed"
        ),
    ),
]


@pytest.mark.cuda
@pytest.mark.parametrize(("name", "block_size"), BACKENDS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_matches_reference(name: str, block_size: int, heads: int, kv_heads: int) -> None:
    rng = np.random.default_rng(0)
    step = random_step(
        rng,
        ["prefill", "decode", "chunk", "verify"],
        heads,
        kv_heads,
        64,
        block_size,
        dtype=torch.bfloat16,
    )
    expected = float32_reference(step, 0.125)
    backend = attention_backend_class(name, torch.device("cuda"))(heads, kv_heads, 64, 0.125)
    t = step.q.shape[0]
    cache = (step.key_cache.cuda(), step.value_cache.cuda())
    metadata = backend.build_metadata(step.inputs, torch.device("cuda"))
    out = backend.forward(
        step.q.view(t, heads, 64).cuda(),
        step.k.view(t, kv_heads, 64).cuda(),
        step.v.view(t, kv_heads, 64).cuda(),
        cache,
        metadata,
    )
    torch.testing.assert_close(out.reshape(t, -1).float().cpu(), expected, rtol=2e-2, atol=2e-2)


def test_unavailable_backends_fail_with_a_clear_message() -> None:
    for name, available in (
        ("flash_attn", flash_attn_available()),
        ("xformers", xformers_available()),
    ):
        if not available:
            with pytest.raises(ConfigError, match=name):
                attention_backend_class(name, torch.device("cpu"))
    with pytest.raises(ConfigError, match="unknown attention backend 'nope'"):
        attention_backend_class("nope", torch.device("cpu"))
