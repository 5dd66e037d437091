"""The torch paged-attention backend against the slow per-query reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.kernels.attention import PAD_SLOT, AttentionInputs
from specbatch.kernels.attention.torch_ref import TorchAttentionBackend
from tests.kernels.reference_attention import RandomStep, random_step, reference_attention


def run_backend(
    backend: TorchAttentionBackend, step: RandomStep, inputs: AttentionInputs
) -> torch.Tensor:
    """The backend on a step, with q/k/v in its [T, heads, dim] layout; [T, heads * dim] out."""
    t, dim = step.q.shape[0], backend.head_dim
    metadata = backend.build_metadata(inputs, torch.device("cpu"))
    out = backend.forward(
        step.q.view(t, -1, dim),
        step.k.view(t, -1, dim),
        step.v.view(t, -1, dim),
        (step.key_cache, step.value_cache),
        metadata,
    )
    return out.reshape(t, -1)


MIXES = {
    "prefill": ["prefill"],
    "decodes": ["decode"] * 5,
    "verify": ["verify"] * 4,
    "mixed": ["prefill", "decode", "chunk", "verify", "decode", "verify", "chunk"],
    "one-token": ["decode"],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_reference(mix: str, heads: int, kv_heads: int, block_size: int) -> None:
    rng = np.random.default_rng(hash((mix, heads, block_size)) % 2**32)
    dim = 16
    step = random_step(rng, MIXES[mix], heads, kv_heads, dim, block_size)
    backend = TorchAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    ref_k, ref_v = step.key_cache.clone(), step.value_cache.clone()
    expected = reference_attention(step.q, step.k, step.v, ref_k, ref_v, step.inputs, dim**-0.5)
    got = run_backend(backend, step, step.inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.key_cache, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(step.value_cache, ref_v, rtol=0, atol=0)


def test_tree_mask_matches_reference() -> None:
    rng = np.random.default_rng(7)
    step = random_step(rng, ["verify", "chunk", "verify", "decode"], 4, 2, 16, 8, tree=True)
    backend = TorchAttentionBackend(4, 2, 16, 0.25)
    expected = reference_attention(
        step.q, step.k, step.v, step.key_cache.clone(), step.value_cache.clone(), step.inputs, 0.25
    )
    got = run_backend(backend, step, step.inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_pad_slot_is_never_written() -> None:
    rng = np.random.default_rng(1)
    step = random_step(rng, ["decode", "verify", "decode"], 4, 2, 16, 8)
    slots = step.inputs.slot_mapping.copy()
    padded = [0, len(slots) - 1]
    slots[padded] = PAD_SLOT
    inputs = AttentionInputs(
        step.inputs.query_lens, step.inputs.seq_lens, step.inputs.block_tables, slots, 8
    )
    before_k, before_v = step.key_cache.clone(), step.value_cache.clone()
    backend = TorchAttentionBackend(4, 2, 16, 0.25)
    expected = reference_attention(
        step.q, step.k, step.v, before_k.clone(), before_v.clone(), inputs, 0.25
    )
    got = run_backend(backend, step, inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    flat_k = step.key_cache.view(-1, 2, 16)
    for t in padded:
        original = step.inputs.slot_mapping[t]
        torch.testing.assert_close(flat_k[original], before_k.view(-1, 2, 16)[original])


def test_bfloat16_close_to_float32_reference() -> None:
    rng = np.random.default_rng(3)
    step = random_step(rng, MIXES["mixed"], 6, 2, 16, 16, dtype=torch.bfloat16)
    backend = TorchAttentionBackend(6, 2, 16, 0.25)
    expected = reference_attention(
        step.q.float(),
        step.k.float(),
        step.v.float(),
        step.key_cache.float(),
        step.value_cache.float(),
        step.inputs,
        0.25,
    )
    got = run_backend(backend, step, step.inputs)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
