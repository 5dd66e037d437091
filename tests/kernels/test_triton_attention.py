"""The Triton paged-attention kernel against the slow reference (CPU: TRITON_INTERPRET=1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from specbatch.kernels.attention import PAD_SLOT, AttentionInputs
from specbatch.kernels.attention.triton_backend import TileConfig, TritonAttentionBackend
from tests.kernels.reference_attention import random_step, reference_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MIXES = {
    "prefill": ["prefill"],
    "chunk": ["chunk"],
    "decodes": ["decode", "decode", "decode"],
    "verify": ["verify", "verify"],
    "mixed": ["prefill", "decode", "chunk", "verify", "decode"],
}


def run(
    backend: TritonAttentionBackend, step, inputs: AttentionInputs, window: int | None = None
) -> torch.Tensor:  # type: ignore[no-untyped-def]
    t, dim = step.q.shape[0], backend.head_dim
    metadata = backend.build_metadata(inputs, DEVICE)
    cache = (step.key_cache.to(DEVICE), step.value_cache.to(DEVICE))
    out = backend.forward(
        step.q.view(t, -1, dim).to(DEVICE),
        step.k.view(t, -1, dim).to(DEVICE),
        step.v.view(t, -1, dim).to(DEVICE),
        cache,
        metadata,
        window=window,
    )
    step.key_cache.copy_(cache[0].cpu())
    step.value_cache.copy_(cache[1].cpu())
    return out.reshape(t, -1).float().cpu()


CASES = [
    # (mix, heads, kv_heads, head_dim, block_size)
    ("mixed", 4, 4, 64, 16),
    ("mixed", 6, 2, 64, 32),
    ("mixed", 8, 1, 128, 16),
    ("prefill", 3, 1, 64, 32),
    ("chunk", 8, 1, 64, 16),
    ("decodes", 6, 2, 128, 32),
    ("verify", 4, 4, 128, 16),
    ("mixed", 4, 1, 256, 16),  # Gemma 3 270M's heads
]


@pytest.mark.parametrize(("mix", "heads", "kv_heads", "dim", "block_size"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(
    mix: str, heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype
) -> None:
    rng = np.random.default_rng(hash((mix, heads, dim, block_size)) % 2**32)
    step = random_step(rng, MIXES[mix], heads, kv_heads, dim, block_size, dtype=dtype)
    backend = TritonAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    ref_k, ref_v = step.key_cache.float(), step.value_cache.float()
    expected = reference_attention(
        step.q.float(), step.k.float(), step.v.float(), ref_k, ref_v, step.inputs, dim**-0.5
    )
    got = run(backend, step, step.inputs)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(step.key_cache.float(), ref_k, rtol=0, atol=0)


def test_split_kv_equals_single_pass() -> None:
    rng = np.random.default_rng(11)
    step = random_step(rng, ["decode", "verify", "chunk"], 4, 2, 64, 16)
    expected = reference_attention(
        step.q, step.k, step.v, step.key_cache.clone(), step.value_cache.clone(), step.inputs, 0.125
    )
    backend = TritonAttentionBackend(4, 2, 64, 0.125)
    backend.decode_tiles = TileConfig(rows=16, block_n=16)
    backend.prefill_tiles = TileConfig(rows=64, block_n=16)
    backend.force_splits = 3
    got = run(backend, step, step.inputs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [1, 5, 17, 1000])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_sliding_window_and_soft_cap(window: int, softcap: float | None) -> None:
    """A sliding layer's queries see their last ``window`` positions (one: themselves only;
    more than the sequence: all), whatever the mix, and soft-capped scores."""
    rng = np.random.default_rng(window)
    step = random_step(rng, ["prefill", "decode", "chunk", "verify", "decode"], 4, 2, 64, 16)
    expected = reference_attention(
        step.q, step.k, step.v, step.key_cache.clone(), step.value_cache.clone(), step.inputs,
        0.125, window, softcap,
    )  # fmt: skip
    backend = TritonAttentionBackend(4, 2, 64, 0.125)
    backend.softcap = softcap
    got = run(backend, step, step.inputs, window)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    split = TritonAttentionBackend(4, 2, 64, 0.125)
    split.softcap, split.force_splits = softcap, 3
    split.decode_tiles = TileConfig(rows=16, block_n=16)
    torch.testing.assert_close(
        run(split, step, step.inputs, window), expected, rtol=1e-4, atol=1e-4
    )


def test_tree_mask() -> None:
    rng = np.random.default_rng(5)
    step = random_step(rng, ["verify", "verify", "chunk"], 4, 2, 64, 16, tree=True)
    expected = reference_attention(
        step.q, step.k, step.v, step.key_cache.clone(), step.value_cache.clone(), step.inputs, 0.125
    )
    got = run(TritonAttentionBackend(4, 2, 64, 0.125), step, step.inputs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_pad_slot_is_never_written() -> None:
    rng = np.random.default_rng(2)
    step = random_step(rng, ["decode", "verify"], 4, 2, 64, 16)
    slots = step.inputs.slot_mapping.copy()
    slots[[0, len(slots) - 1]] = PAD_SLOT
    inputs = AttentionInputs(
        step.inputs.query_lens, step.inputs.seq_lens, step.inputs.block_tables, slots, 16
    )
    before = step.key_cache.clone()
    expected = reference_attention(
        step.q, step.k, step.v, before.clone(), step.value_cache.clone(), inputs, 0.125
    )
    got = run(TritonAttentionBackend(4, 2, 64, 0.125), step, inputs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    flat = step.key_cache.view(-1, 2, 64)
    for t in (0, len(slots) - 1):
        original = step.inputs.slot_mapping[t]
        torch.testing.assert_close(flat[original], before.view(-1, 2, 64)[original])


def test_engine_with_triton_backend_equals_torch_backend(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from specbatch import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9] * 4, [30, 31], list(range(40, 75))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = {
        "dtype": "float32",  # on CUDA "auto" is bf16, where two backends may round apart
        "num_kv_blocks": 64,
        "block_size": 16,
        "max_model_len": 128,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
    }
    torch_out = LLM(str(tiny_model_dir), attention_backend="torch", **kwargs).generate(
        prompts, params, use_tqdm=False
    )
    triton_out = LLM(str(tiny_model_dir), attention_backend="triton", **kwargs).generate(
        prompts, params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in triton_out] == [
        o.outputs[0].token_ids for o in torch_out
    ]


@pytest.mark.parametrize("splits", [1, 3])
def test_fillers_are_neither_read_nor_computed(splits: int) -> None:
    """Trailing fillers (slot -1, past kv_lens) of a CUDA-graph step: the real rows equal the
    step without them, filler rows are zeros, and NaN where the fillers' K/V would sit (stale
    memory) reaches nothing."""
    rng = np.random.default_rng(21)
    step = random_step(rng, ["verify", "decode", "verify", "chunk", "verify"], 8, 2, 64, 16)
    inputs = step.inputs
    fillers = np.array([min(2, q - 1) if q > 1 and q < 10 else 0 for q in inputs.query_lens])
    starts = inputs.query_start_loc
    keep = np.ones(inputs.num_tokens, dtype=bool)
    for b, f in enumerate(fillers):
        keep[starts[b + 1] - f : starts[b + 1]] = False
    assert (~keep).sum() >= 4
    # the step without fillers, attended by the reference
    reduced = AttentionInputs(
        inputs.query_lens - fillers,
        inputs.seq_lens - fillers,
        inputs.block_tables,
        inputs.slot_mapping[keep],
        16,
    )
    expected = reference_attention(
        step.q[keep],
        step.k[keep],
        step.v[keep],
        step.key_cache.clone(),
        step.value_cache.clone(),
        reduced,
        0.125,
    )
    # with fillers: no slots, poisoned cache where they would have been written
    filler_slots = inputs.slot_mapping[~keep]
    for cache in (step.key_cache, step.value_cache):
        flat = cache.view(-1, 2, 64)
        flat[torch.from_numpy(filler_slots)] = float("nan")
    slots = inputs.slot_mapping.copy()
    slots[~keep] = PAD_SLOT
    padded = AttentionInputs(
        inputs.query_lens,
        inputs.seq_lens,
        inputs.block_tables,
        slots,
        16,
        kv_lens=inputs.seq_lens - fillers,
    )
    backend = TritonAttentionBackend(8, 2, 64, 0.125)
    backend.force_splits = splits
    got = run(backend, step, padded)
    torch.testing.assert_close(got[torch.from_numpy(keep)], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[torch.from_numpy(~keep)], torch.zeros_like(got[torch.from_numpy(~keep)]))
