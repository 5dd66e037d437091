"""The CPU paged-attention backends against the slow per-query reference: the reference torch
backend (gather + SDPA) and the in-place C kernel (``cpu``), which must also give a sequence's
rows bit for bit the same in any batch and however its prompt is cut into chunks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specbatch.kernels.attention import PAD_SLOT, AttentionInputs, cpu_paged
from specbatch.kernels.attention.cpu_paged import CpuPagedBackend, CpuPagedMetadata
from specbatch.kernels.attention.torch_ref import TorchAttentionBackend
from specbatch.kernels.cbuild import NativeLibrary
from tests.kernels.reference_attention import (
    RandomStep,
    float32_reference,
    random_step,
    reference_attention,
)


def run_backend(
    backend: TorchAttentionBackend,
    step: RandomStep,
    inputs: AttentionInputs,
    window: int | None = None,
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
        window=window,
    )
    return out.reshape(t, -1)


BACKENDS = [TorchAttentionBackend, CpuPagedBackend]


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    """The C kernel must build here: a silent fallback would test the reference twice."""
    assert cpu_paged.load_library() is not None


MIXES = {
    "prefill": ["prefill"],
    "decodes": ["decode"] * 5,
    "verify": ["verify"] * 4,
    "mixed": ["prefill", "decode", "chunk", "verify", "decode", "verify", "chunk"],
    "one-token": ["decode"],
    "long": ["long-decode", "long-verify", "decode", "long-decode", "chunk"],
}


@pytest.mark.parametrize("backend_class", BACKENDS)
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 4, 16), (6, 2, 16), (8, 1, 16), (9, 3, 64)]
)
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_reference(
    backend_class: type[TorchAttentionBackend],
    mix: str,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
) -> None:
    rng = np.random.default_rng(hash((mix, heads, block_size)) % 2**32)
    step = random_step(rng, MIXES[mix], heads, kv_heads, dim, block_size)
    backend = backend_class(heads, kv_heads, dim, dim**-0.5)
    ref_k, ref_v = step.key_cache.clone(), step.value_cache.clone()
    expected = reference_attention(step.q, step.k, step.v, ref_k, ref_v, step.inputs, dim**-0.5)
    got = run_backend(backend, step, step.inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.key_cache, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(step.value_cache, ref_v, rtol=0, atol=0)


@pytest.mark.parametrize("backend_class", BACKENDS)
def test_tree_mask_matches_reference(backend_class: type[TorchAttentionBackend]) -> None:
    rng = np.random.default_rng(7)
    kinds = ["verify", "chunk", "long-verify", "verify", "decode"]
    step = random_step(rng, kinds, 4, 2, 16, 8, tree=True)
    backend = backend_class(4, 2, 16, 0.25)
    expected = reference_attention(
        step.q, step.k, step.v, step.key_cache.clone(), step.value_cache.clone(), step.inputs, 0.25
    )
    got = run_backend(backend, step, step.inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "dim"),
    [(5, 9, 3, 64), (12, 9, 3, 64), (12, 4, 2, 16), (16, 6, 2, 24), (16, 9, 3, 64)],
)
def test_a_tree_row_hidden_from_a_chunks_first_block_stays_finite(
    seed: int, block_size: int, heads: int, kv_heads: int, dim: int
) -> None:
    """A tree row that sees nothing in the first block of a chunk but something later in it
    (a prefill's late token whose tree hides the first block): the scalar path (a block size
    or head dim that is not a multiple of 16) once gave it NaN; the vector path for contrast."""
    rng = np.random.default_rng(seed)
    step = random_step(rng, MIXES["mixed"], heads, kv_heads, dim, block_size, tree=True)
    # thin the random ancestor sets so whole blocks of new tokens are hidden from many rows
    mask = step.inputs.tree_mask
    assert mask is not None
    starts = step.inputs.query_start_loc
    own = np.concatenate([np.arange(n) for n in step.inputs.query_lens])
    mask = mask & (rng.random(mask.shape) < 0.2)
    mask[np.arange(len(own)), own] = True
    inputs = dataclasses.replace(step.inputs, tree_mask=mask)
    first_block_hidden = [
        not mask[t, :block_size].any()
        for b in range(len(starts) - 1)
        if step.inputs.seq_lens[b] == step.inputs.query_lens[b]  # a prefill from position 0
        for t in range(int(starts[b]) + block_size, int(starts[b + 1]))
    ]
    assert any(first_block_hidden)  # the case is there
    backend = CpuPagedBackend(heads, kv_heads, dim, dim**-0.5)
    expected = reference_attention(
        step.q, step.k, step.v, step.key_cache.clone(), step.value_cache.clone(), inputs, dim**-0.5
    )
    got = run_backend(backend, step, inputs)
    bad_rows = (~torch.isfinite(got)).any(dim=1).nonzero().flatten().tolist()
    assert not bad_rows, f"non-finite rows {bad_rows}"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_class", BACKENDS)
def test_pad_slot_is_never_written(backend_class: type[TorchAttentionBackend]) -> None:
    rng = np.random.default_rng(1)
    step = random_step(rng, ["decode", "verify", "decode"], 4, 2, 16, 8)
    slots = step.inputs.slot_mapping.copy()
    padded = [0, len(slots) - 1]
    slots[padded] = PAD_SLOT
    inputs = AttentionInputs(
        step.inputs.query_lens, step.inputs.seq_lens, step.inputs.block_tables, slots, 8
    )
    before_k, before_v = step.key_cache.clone(), step.value_cache.clone()
    backend = backend_class(4, 2, 16, 0.25)
    expected = reference_attention(
        step.q, step.k, step.v, before_k.clone(), before_v.clone(), inputs, 0.25
    )
    got = run_backend(backend, step, inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    flat_k = step.key_cache.view(-1, 2, 16)
    for t in padded:
        original = step.inputs.slot_mapping[t]
        torch.testing.assert_close(flat_k[original], before_k.view(-1, 2, 16)[original])


@pytest.mark.parametrize("backend_class", BACKENDS)
def test_bfloat16_close_to_float32_reference(backend_class: type[TorchAttentionBackend]) -> None:
    rng = np.random.default_rng(3)
    step = random_step(rng, MIXES["mixed"], 6, 2, 16, 16, dtype=torch.bfloat16)
    backend = backend_class(6, 2, 16, 0.25)
    expected = float32_reference(step, 0.25)
    got = run_backend(backend, step, step.inputs)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_the_kernel_takes_every_query() -> None:
    rng = np.random.default_rng(5)
    step = random_step(rng, MIXES["mixed"], 6, 2, 16, 16)
    assert (step.inputs.query_lens > 16).any()  # prefill chunks too
    metadata = CpuPagedBackend(6, 2, 16, 0.25).build_metadata(step.inputs, torch.device("cpu"))
    assert isinstance(metadata, CpuPagedMetadata)
    assert metadata.queries is not None
    assert len(metadata.queries.q_len) == len(step.inputs.query_lens)
    assert metadata.groups == []  # the reference path attends nothing


def test_a_sequence_gives_the_same_bits_alone_and_in_any_batch() -> None:
    rng = np.random.default_rng(11)
    kinds = ["decode", "verify", "long-decode", "long-verify", "decode"]
    step = random_step(rng, kinds, 9, 3, 64, 16)
    backend = CpuPagedBackend(9, 3, 64, 0.125)
    together = run_backend(backend, step, step.inputs)
    starts = step.inputs.query_start_loc
    for b in range(len(step.inputs.query_lens)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        alone = AttentionInputs(
            step.inputs.query_lens[b : b + 1],
            step.inputs.seq_lens[b : b + 1],
            step.inputs.block_tables[b : b + 1],
            step.inputs.slot_mapping[rows],
            16,
        )
        t = rows.stop - rows.start
        metadata = backend.build_metadata(alone, torch.device("cpu"))
        out = backend.forward(
            step.q[rows].view(t, -1, 64),
            step.k[rows].view(t, -1, 64),
            step.v[rows].view(t, -1, 64),
            (step.key_cache, step.value_cache),
            metadata,
        )
        assert torch.equal(out.reshape(t, -1), together[rows]), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [300, 700])
def test_a_token_gets_the_same_bits_in_any_chunk(dtype: torch.dtype, length: int) -> None:
    """A prompt token attended inside a whole prefill, inside a short last chunk (as after a
    prefix-cache hit) and as a decode gives the same bits: one code path for every length."""
    heads, kv_heads, dim, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(length)
    blocks = -(-length // block)
    table = np.random.default_rng(length).permutation(blocks + 3)[None, :blocks].astype(np.int64)
    key_cache = torch.randn(blocks + 3, block, kv_heads, dim, generator=gen).to(dtype)
    value_cache = torch.randn(blocks + 3, block, kv_heads, dim, generator=gen).to(dtype)
    positions = np.arange(length)
    slots = table[0, positions // block] * block + positions % block
    q = torch.randn(length, heads, dim, generator=gen)
    # K/V as already in the cache, so every cut writes the same values
    k = key_cache.view(-1, kv_heads, dim)[torch.from_numpy(slots)].clone()
    v = value_cache.view(-1, kv_heads, dim)[torch.from_numpy(slots)].clone()
    backend = CpuPagedBackend(heads, kv_heads, dim, dim**-0.5)

    def last_rows(chunk: int) -> torch.Tensor:
        inputs = AttentionInputs(
            np.array([chunk]), np.array([length]), table, slots[length - chunk :], block
        )
        metadata = backend.build_metadata(inputs, torch.device("cpu"))
        rows = slice(length - chunk, length)
        out = backend.forward(q[rows], k[rows], v[rows], (key_cache, value_cache), metadata)
        return out[-1]

    whole = last_rows(length)
    expected = reference_attention(
        q.reshape(length, -1).float(),
        k.reshape(length, -1),
        v.reshape(length, -1),
        key_cache.clone(),
        value_cache.clone(),
        AttentionInputs(np.array([length]), np.array([length]), table, slots, block),
        dim**-0.5,
    )[-1].view(heads, dim)
    torch.testing.assert_close(whole.float(), expected.float(), rtol=1e-2, atol=1e-2)
    for chunk in (1, 3, 17, 200):
        assert torch.equal(last_rows(chunk), whole), chunk


def test_without_a_compiler_the_reference_path_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_paged, "NATIVE", cpu_paged.NATIVE.fresh())  # not built in this process
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "/nonexistent/cc")
    rng = np.random.default_rng(9)
    step = random_step(rng, MIXES["mixed"], 6, 2, 16, 16)
    backend = CpuPagedBackend(6, 2, 16, 0.25)
    expected = reference_attention(
        step.q, step.k, step.v, step.key_cache.clone(), step.value_cache.clone(), step.inputs, 0.25
    )
    got = run_backend(backend, step, step.inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert cpu_paged.load_library() is None
    assert "could not be built" in caplog.text
    metadata = backend.build_metadata(step.inputs, torch.device("cpu"))
    assert getattr(metadata, "queries", None) is None


def test_a_slot_outside_the_cache_is_refused_not_written() -> None:
    rng = np.random.default_rng(4)
    step = random_step(rng, ["decode", "decode"], 4, 2, 16, 8)
    slots = step.inputs.slot_mapping.copy()
    slots[-1] = step.key_cache.shape[0] * 8  # one past the last slot
    inputs = AttentionInputs(
        step.inputs.query_lens, step.inputs.seq_lens, step.inputs.block_tables, slots, 8
    )
    with pytest.raises(IndexError, match="outside the cache"):
        run_backend(CpuPagedBackend(4, 2, 16, 0.25), step, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (4, 2, 32, 32)]
)
def test_the_eight_lane_path_gives_the_sixteen_lane_bits(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    tree: bool,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
) -> None:
    """Without AVX-512 the vector path works on 8-lane halves; built with -DSIXTEEN_LANES it
    takes the 16-lane path instead, which must give the same bits on every kind of query,
    block edge, masked position and tree (on an AVX-512 machine both builds are that path)."""
    rng = np.random.default_rng(5)
    kinds = ["prefill", "decode", "chunk", "verify", "long-decode", "long-verify", "decode"]
    step = random_step(rng, kinds, heads, kv_heads, dim, block_size, dtype=dtype, tree=tree)
    backend = CpuPagedBackend(heads, kv_heads, dim, dim**-0.5)
    native = run_backend(backend, step, step.inputs)
    sixteen = NativeLibrary(
        cpu_paged.SOURCE,
        (*cpu_paged.FLAGS, "-DSIXTEEN_LANES"),
        "the 16-lane build",
        "the test fails",
        cpu_paged._declare,
    )
    assert sixteen.load() is not None
    monkeypatch.setattr(cpu_paged, "NATIVE", sixteen)
    assert torch.equal(run_backend(backend, step, step.inputs), native)


WINDOWED = [
    # (heads, kv_heads, dim, block_size): the vector path, and the generic one (dim 24)
    (9, 3, 64, 16),
    (4, 2, 24, 16),
]


@pytest.mark.parametrize("backend_class", BACKENDS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), WINDOWED)
@pytest.mark.parametrize("window", [1, 5, 40, 100_000])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_sliding_window_and_soft_cap_match_reference(
    backend_class: type[TorchAttentionBackend],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    window: int,
    softcap: float | None,
) -> None:
    """A sliding layer's queries see their last ``window`` positions (1: themselves; more
    than the sequence: all) across block and 256-position chunk edges, scores soft-capped."""
    rng = np.random.default_rng(window + dim)
    kinds = ["prefill", "decode", "chunk", "verify", "long-decode", "long-verify"]
    step = random_step(rng, kinds, heads, kv_heads, dim, block_size)
    scale = dim**-0.5
    expected = reference_attention(
        step.q, step.k, step.v, step.key_cache.clone(), step.value_cache.clone(), step.inputs,
        scale, window, softcap,
    )  # fmt: skip
    backend = backend_class(heads, kv_heads, dim, scale)
    backend.softcap = softcap
    got = run_backend(backend, step, step.inputs, window)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_windowed_sequence_gives_the_same_bits_alone_and_in_any_chunk() -> None:
    """With a window of 40 over 300 positions: the last token's row alone in a decode, in a
    short last chunk and in the whole prefill, the same bits."""
    heads, kv_heads, dim, block, length = 9, 3, 64, 16, 300
    gen = torch.Generator().manual_seed(3)
    blocks = -(-length // block)
    table = np.random.default_rng(3).permutation(blocks + 3)[None, :blocks].astype(np.int64)
    key_cache = torch.randn(blocks + 3, block, kv_heads, dim, generator=gen)
    value_cache = torch.randn(blocks + 3, block, kv_heads, dim, generator=gen)
    positions = np.arange(length)
    slots = table[0, positions // block] * block + positions % block
    q = torch.randn(length, heads, dim, generator=gen)
    k = key_cache.view(-1, kv_heads, dim)[torch.from_numpy(slots)].clone()
    v = value_cache.view(-1, kv_heads, dim)[torch.from_numpy(slots)].clone()
    backend = CpuPagedBackend(heads, kv_heads, dim, dim**-0.5)
    backend.softcap = 4.0

    def last_row(chunk: int) -> torch.Tensor:
        inputs = AttentionInputs(
            np.array([chunk]), np.array([length]), table, slots[length - chunk :], block
        )
        metadata = backend.build_metadata(inputs, torch.device("cpu"))
        rows = slice(length - chunk, length)
        out = backend.forward(q[rows], k[rows], v[rows], (key_cache, value_cache), metadata, 40)
        return out[-1]

    whole = last_row(length)
    for chunk in (1, 3, 39, 41, 200):
        assert torch.equal(last_row(chunk), whole), chunk


def test_trees_cannot_attend_a_window() -> None:
    rng = np.random.default_rng(4)
    step = random_step(rng, ["verify", "verify"], 4, 2, 16, 16, tree=True)
    for backend_class in BACKENDS:
        with pytest.raises(ValueError, match="sliding window"):
            run_backend(backend_class(4, 2, 16, 0.25), step, step.inputs, window=3)


def test_the_eight_lane_path_gives_the_sixteen_lane_bits_in_a_window() -> None:
    """The AVX2 build's 8-lane halves against its 16-lane build (-DSIXTEEN_LANES) with a
    window and soft-capped scores: the same bits."""
    rng = np.random.default_rng(6)
    kinds = ["prefill", "decode", "chunk", "verify", "long-decode", "long-verify"]
    step = random_step(rng, kinds, 9, 3, 64, 16)
    backend = CpuPagedBackend(9, 3, 64, 0.125)
    backend.softcap = 3.0
    outputs = []
    for extra in ((), ("-DSIXTEEN_LANES",)):
        library = NativeLibrary(
            cpu_paged.SOURCE, (*cpu_paged.FLAGS, "-mno-avx512f", *extra), "an AVX2 build",
            "the test fails", cpu_paged._declare,
        )  # fmt: skip
        assert library.load() is not None
        original = cpu_paged.NATIVE
        cpu_paged.NATIVE = library
        try:
            outputs.append(run_backend(backend, dataclasses.replace(step), step.inputs, 13))
        finally:
            cpu_paged.NATIVE = original
    assert torch.equal(outputs[0], outputs[1])
