"""The AMX form of GGUF blocks (every type of ``TILED_TYPES``): dequantisation equal to gguf's
bit for bit,
products against float64, a row's bits independent of its batch and the thread count, lookups,
named errors; the registry's choice between it and the panel kernel. Skipped where the CPU (or
Linux) gives no AMX tiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.kernels import block_forms, gguf_tiles
from specbatch.kernels.gguf_blocks import BLOCK_TYPES, BlockWeight
from specbatch.kernels.gguf_linear import QuantizedWeight
from specbatch.kernels.gguf_tiles import TILED_TYPES, TileBlockWeight, tile_block_linear
from tests.kernels.test_gguf_blocks import assert_same_bits, gguf_values
from tests.kernels.test_gguf_blocks import random_blocks as random_type_blocks
from tests.kernels.test_gguf_linear import random_blocks

pytestmark = pytest.mark.skipif(not gguf_tiles.available(), reason="no AMX tiles here")

TYPES = sorted(TILED_TYPES)
SHAPES = [(256, 7), (768, 49), (1536, 16), (512, 33), (256, 1)]  # (K, N): N off the 16-columns
ROWS = [1, 2, 15, 16, 17, 64, 257]


def make_weight(kind: str, k: int, n: int, seed: int = 0) -> tuple[TileBlockWeight, np.ndarray]:
    """Random blocks of ggml type ``kind`` (any case): random codes and packed sub-block
    scales, finite fp16 scales of every magnitude; Q4_1 / Q8_0 with every code present."""
    rng = np.random.default_rng(seed)
    if kind.lower() in ("q4_1", "q8_0"):
        raw = random_blocks(rng, kind.lower(), n, k)
    else:
        raw = random_type_blocks(rng, BLOCK_TYPES[kind.upper()], n, k)
    return TileBlockWeight.from_blocks(raw, kind.lower(), k), raw


def float32_error_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """What float32 sums may lose, relative to sum |x| |w|: per block 96 products (three parts
    of each of 32 activations) and the scale's two fused steps, then one sum over the blocks."""
    k = dense.shape[1]
    steps = 96 + 2 + k // 32
    return steps * 2.0**-24 * (x.double().abs() @ dense.double().abs().T)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_dequantisation_is_ggufs_bit_for_bit(kind: str, k: int, n: int) -> None:
    weight, raw = make_weight(kind, k, n)
    expected = gguf_values(raw, BLOCK_TYPES[kind]).reshape(n, k)
    assert_same_bits(weight.dequantize(), expected)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_products_are_float64_within_float32_sums(kind: str, k: int, n: int) -> None:
    weight, _ = make_weight(kind, k, n, seed=k + n)
    dense = weight.dequantize().double()
    generator = torch.Generator().manual_seed(k * n)
    for rows in (1, 5, 17):
        x = torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator)
        error = (tile_block_linear(x, weight).double() - x.double() @ dense.T).abs()
        assert bool((error <= float32_error_bound(x, dense)).all())


@pytest.mark.parametrize("kind", TYPES)
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads(kind: str) -> None:
    weight, _ = make_weight(kind, 512, 200, seed=3)
    x = torch.randn(max(ROWS), 512, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([tile_block_linear(x[i : i + 1], weight) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in ROWS:
                assert torch.equal(tile_block_linear(x[:rows], weight), alone[:rows]), rows
                tail = x[len(x) - rows :]  # other batch-mates for the same rows
                assert torch.equal(tile_block_linear(tail, weight), alone[len(x) - rows :])
    finally:
        torch.set_num_threads(threads)


def test_empty_batches_special_values_and_a_bias() -> None:
    weight, _ = make_weight("q4_1", 96, 7)
    assert tile_block_linear(torch.empty(0, 96), weight).shape == (0, 7)
    x = torch.randn(3, 96) + 0.5  # (no weight of a column may meet the inf as 0 * inf)
    x[1, 5] = float("inf")
    x[2, 9] = float("nan")
    out = tile_block_linear(x, weight)
    assert bool(out[0].isfinite().all())
    assert not bool(out[1].isfinite().any())  # inf times the column's weights (or a NaN)
    assert bool(out[2].isnan().all())
    bias = torch.randn(7)
    assert torch.equal(weight.multiply(x[:1], bias), tile_block_linear(x[:1], weight) + bias)


@pytest.mark.parametrize("kind", TYPES)
def test_lookups_are_the_dequantised_rows(kind: str) -> None:
    weight, _ = make_weight(kind, 256, 33)
    ids = torch.tensor([[0, 32], [17, 5]])
    assert torch.equal(weight.rows(ids), weight.dequantize()[ids])
    assert weight.rows(torch.empty(0, dtype=torch.int64)).shape == (0, 256)
    with pytest.raises(IndexError, match=r"\[0, 33\)"):
        weight.rows(torch.tensor([33]))
    with pytest.raises(IndexError, match=r"\[0, 33\)"):
        weight.rows(torch.tensor([-1]))


@pytest.mark.parametrize("kind", TYPES)
def test_the_file_is_the_size_of_its_blocks(kind: str) -> None:
    """The 32-blocks' records are their bytes rearranged; a super-block type keeps its codes
    and takes a float32 scale (and minimum) per 32 weights for its packed ones."""
    weight, raw = make_weight(kind, 512, 64)
    if kind in ("Q4_K", "Q5_K", "IQ4_XS"):
        weights, blocks = 64 * 512, 64 * 512 // 32
        codes = weights // 2 + (weights // 8 if kind == "Q5_K" else 0)
        assert weight.nbytes == codes + blocks * 4 * (1 if kind == "IQ4_XS" else 2)
    else:
        assert weight.nbytes == raw.nbytes


def test_bad_bytes_and_shapes_are_named() -> None:
    raw = random_blocks(np.random.default_rng(0), "q8_0", 4, 64)
    with pytest.raises(ValueError, match=r"truncated or misaligned.*uint8 \[rows, 68\]"):
        TileBlockWeight.from_blocks(raw[:, :-1], "q8_0", 64)  # a truncated row
    with pytest.raises(ValueError, match="multiple of Q8_0's block of 32"):
        TileBlockWeight.from_blocks(raw, "q8_0", 48)
    with pytest.raises(ValueError, match="multiple of Q4_K's block of 256"):
        TileBlockWeight.from_blocks(raw, "q4_k", 64)
    with pytest.raises(ValueError, match="kind must be one of"):
        TileBlockWeight.from_blocks(raw, "q6_k", 64)
    weight = TileBlockWeight.from_blocks(raw, "q8_0", 64)
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        tile_block_linear(torch.randn(2, 32), weight)


def test_dense_weights_quantize_as_ggml_does_in_either_form() -> None:
    dense = torch.randn(40, 96, generator=torch.Generator().manual_seed(5))
    tiles = TileBlockWeight.from_dense(dense)
    assert torch.equal(tiles.dequantize(), QuantizedWeight.from_dense(dense).dequantize())
    assert type(block_forms.q8_0_form(dense)) is TileBlockWeight


def test_the_registry_holds_the_tiled_types_in_tiles_here_and_elsewhere_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = random_blocks(np.random.default_rng(1), "q4_1", 16, 64)
    k_raw = random_type_blocks(np.random.default_rng(2), BLOCK_TYPES["Q4_K"], 16, 256)
    q6_raw = random_type_blocks(np.random.default_rng(2), BLOCK_TYPES["Q6_K"], 16, 256)
    assert type(block_forms.block_form("Q4_1", raw, 64)) is TileBlockWeight
    assert type(block_forms.block_form("Q4_K", k_raw, 256)) is TileBlockWeight
    assert type(block_forms.block_form("Q6_K", q6_raw, 256)) is BlockWeight
    monkeypatch.setattr(gguf_tiles, "available", lambda: False)
    assert type(block_forms.block_form("Q4_1", raw, 64)) is QuantizedWeight
    assert type(block_forms.block_form("Q4_K", k_raw, 256)) is BlockWeight
    assert type(block_forms.q8_0_form(torch.randn(8, 64))) is QuantizedWeight
