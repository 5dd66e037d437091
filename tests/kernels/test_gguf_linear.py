"""The GGUF Q4_1 / Q8_0 linear kernel: dequantisation equal to gguf's bit for bit, products
against float64, a row's bits independent of its batch, the thread count and the code path
(registers, scratch tile, plain C), and the fallback where no compiler works."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specbatch.kernels import gguf_linear
from specbatch.kernels.cbuild import load_c_library
from specbatch.kernels.gguf_linear import QuantizedWeight, quantized_linear

QTYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
SHAPES = [(96, 7), (576, 49), (1536, 1), (160, 33)]  # (K, N): K % 256 != 0, N off the tiles
BATCHES = [1, 2, 3, 5, 17, 64]  # in registers (Q4_1 to 6 rows, Q8_0 to 2), then a scratch tile


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    """The C kernel must build here: a silent fallback would test the reference twice."""
    assert gguf_linear.kernel_available()


def random_fp16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """fp16 bit patterns of every kind but inf and NaN: zeros, subnormals, tiny, up to 65504,
    both signs (as uint8 pairs)."""
    bits = rng.integers(0, 0x7C00, shape, dtype=np.uint16)
    bits |= rng.integers(0, 2, shape, dtype=np.uint16) << 15
    return bits.view(np.uint8).reshape(*shape[:-1], 2 * shape[-1])


def random_blocks(rng: np.random.Generator, kind: str, n: int, k: int) -> np.ndarray:
    """A tensor's raw bytes as in a GGUF file: uint8 [n, k / 32 * block bytes]."""
    blocks = k // 32
    if kind == "q4_1":
        codes = rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8)
        codes[0, 0] = np.arange(16) | (15 - np.arange(16)) << 4  # every nibble, both halves
        scales = random_fp16(rng, (n, blocks, 2))  # d, m
    else:
        codes = rng.integers(0, 256, (n, blocks, 32), dtype=np.uint8)
        codes[0, 0, :3] = [0x80, 0x7F, 0]  # -128, 127, 0
        scales = random_fp16(rng, (n, blocks, 1))
    return np.concatenate([scales, codes], axis=-1).reshape(n, -1)


def make_weight(kind: str, k: int, n: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    raw = random_blocks(np.random.default_rng(seed), kind, n, k)
    return QuantizedWeight.from_blocks(raw, kind, k), raw


def assert_near_product(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> None:
    """Within float32 summation error of the float64 product with the dequantised weights:
    relative to sum |x| |w|, as the terms' magnitudes span fp16's whole range."""
    dense = weight.dequantize().double()
    error = (got.double() - x.double() @ dense.T).abs()
    assert bool((error <= 1e-5 * (x.double().abs() @ dense.abs().T)).all())


@pytest.mark.parametrize("kind", QTYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_dequantize_equals_gguf_bit_for_bit(kind: str, k: int, n: int) -> None:
    weight, raw = make_weight(kind, k, n)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, QTYPES[kind]).astype(np.float32))
    assert (weight.out_features, weight.in_features) == (n, k)
    assert torch.equal(weight.dequantize(), expected)
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(weight.rows(ids), expected[ids])
    assert torch.equal(weight.rows(ids.view(2, 2)), expected[ids].view(2, 2, k))
    for bad in (n, -1):  # a padding row, a wrapped index
        with pytest.raises(IndexError, match="row ids"):
            weight.rows(torch.tensor([0, bad]))
        with pytest.raises(IndexError, match="row ids"):
            weight.rows_reference(torch.tensor([0, bad]))


@pytest.mark.parametrize("kind", QTYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_the_c_lookup_equals_the_torch_one(kind: str, k: int, n: int) -> None:
    """An embedding lookup by the C library against the same operations as torch calls: the
    same bits for random ids (repeats, both ends, every panel position), one id, none."""
    assert gguf_linear.load_library() is not None
    weight, _ = make_weight(kind, k, n, seed=n)
    rng = np.random.default_rng(k)
    for ids in (
        torch.from_numpy(rng.integers(0, n, 37)),
        torch.tensor([0, n - 1, n - 1, 0]),
        torch.tensor([n // 2]),
        torch.tensor([], dtype=torch.int64),
        torch.arange(n).view(-1, 1).to(torch.int32),
    ):
        got, expected = weight.rows(ids), weight.rows_reference(ids)
        assert got.shape == expected.shape == (*ids.shape, k)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", QTYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 6, 7, 70])
def test_product_matches_float64(kind: str, k: int, n: int, m: int) -> None:
    weight, _ = make_weight(kind, k, n, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = quantized_linear(x, weight)
    assert got.dtype == torch.float32
    assert got.shape == (m, n)
    assert_near_product(got, x, weight)


@pytest.mark.parametrize("kind", QTYPES)
@pytest.mark.parametrize(("k", "n"), [(576, 49), (160, 33)])
def test_a_row_has_the_same_bits_in_any_batch(kind: str, k: int, n: int) -> None:
    weight, _ = make_weight(kind, k, n)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([quantized_linear(x[i : i + 1], weight) for i in range(64)])
    for size in BATCHES:
        batched = torch.cat([quantized_linear(part, weight) for part in x.split(size)])
        assert torch.equal(batched, alone), size


@pytest.mark.parametrize("kind", QTYPES)
@pytest.mark.usefixtures("two_threads")
def test_the_thread_count_changes_no_bit(kind: str) -> None:
    weight, _ = make_weight(kind, 576, 200)
    x = torch.randn(30, 576, generator=torch.Generator().manual_seed(2))
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append([quantized_linear(x[:m], weight) for m in (1, 5, 30)])
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)


@pytest.mark.parametrize("kind", QTYPES)
@pytest.mark.parametrize(
    "disabled",
    [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma")],
    ids=["avx2", "plain"],
)
def test_each_instruction_set_gives_the_same_bits(kind: str, disabled: tuple[str, ...]) -> None:
    """Built without AVX-512 the kernel takes its AVX2 path, without AVX2 its plain C path;
    each must agree bit for bit with this machine's build (on an AVX2 machine the first is
    this machine's build itself), at every row count its paths split on."""
    flags = (*gguf_linear.FLAGS, *disabled)
    other = load_c_library(gguf_linear.SOURCE, flags, "a reduced build", "test fails")
    assert other is not None
    gguf_linear.declare(other)
    native = gguf_linear.vector_isa()
    expected = "plain" if "-mno-avx2" in disabled or native == "plain" else "avx2"
    assert gguf_linear.VECTOR_ISAS[other.gguf_linear_isa()] == expected  # the path it says
    weight, _ = make_weight(kind, 160, 33)
    x = torch.randn(30, 160, generator=torch.Generator().manual_seed(3))
    for m in (1, 2, 3, 4, 5, 6, 7, 30):
        assert torch.equal(
            gguf_linear.run_kernel(other, x[:m], weight), quantized_linear(x[:m], weight)
        ), m


@pytest.mark.parametrize("kind", QTYPES)
def test_no_rows(kind: str) -> None:
    weight, _ = make_weight(kind, 96, 7)
    assert quantized_linear(torch.empty(0, 96), weight).shape == (0, 7)


def test_a_strided_input_is_copied_and_a_wrong_one_refused() -> None:
    weight, _ = make_weight("q4_1", 96, 7)
    wide = torch.randn(5, 192)
    assert torch.equal(
        quantized_linear(wide[:, ::2], weight), quantized_linear(wide[:, ::2].contiguous(), weight)
    )
    for bad in (
        torch.randn(5, 96, dtype=torch.float64),
        torch.randn(5, 96).bfloat16(),
        torch.randn(5, 64),
        torch.randn(96),
    ):
        with pytest.raises(ValueError, match="x must be float32"):
            quantized_linear(bad, weight)


def test_from_blocks_refuses_what_it_cannot_hold() -> None:
    raw = random_blocks(np.random.default_rng(0), "q4_1", 4, 64)
    with pytest.raises(ValueError, match="kind"):
        QuantizedWeight.from_blocks(raw, "q4_0", 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.from_blocks(raw, "q4_1", 48)
    with pytest.raises(ValueError, match="raw must be"):
        QuantizedWeight.from_blocks(raw, "q8_0", 64)


def test_resident_bytes() -> None:
    # Q4_1: panels of 8 rows, 96 bytes per row and 4 blocks; Q8_0: 144
    assert make_weight("q4_1", 576, 49)[0].nbytes == 7 * 8 * 5 * 96
    assert make_weight("q8_0", 576, 49)[0].nbytes == 7 * 8 * 5 * 144


def test_without_a_compiler_the_dense_fallback_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gguf_linear, "NATIVE", gguf_linear.NATIVE.fresh())  # not built yet
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "/nonexistent/cc")
    weight, _ = make_weight("q4_1", 160, 33)
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(4))
    got = quantized_linear(x, weight)
    assert not gguf_linear.kernel_available()
    assert caplog.text.count("could not be built") == 1
    assert_near_product(got, x, weight)
    assert torch.equal(quantized_linear(x[2:3], weight), got[2:3])
