"""The GGUF block dequantizers: every type equal to gguf's numpy bit for bit (every row, and
looked-up ids), the same bits from each instruction set's build and any thread count, the
registry's sizes, refused inputs, and gguf's values where no compiler works."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import gguf
import numpy as np
import pytest
import torch

from specbatch.kernels import gguf_blocks
from specbatch.kernels.cbuild import load_c_library
from specbatch.kernels.gguf_blocks import (
    BLOCK_TYPES,
    BlockType,
    block_type,
    check_rows,
    dequantize_rows,
    dequantize_rows_reference,
)

# Byte offsets of each block's fp16 scales (d, and dmin or m): finite random values there.
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
# zeros, the smallest and largest subnormals, the smallest normal, one, the largest finite
SPECIAL_FP16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF])
IN_FEATURES = {32: (32, 96, 640), 256: (256, 512, 1024)}
CASES = [
    pytest.param(name, k, n, id=f"{name}-{n}x{k}")
    for name, kind in BLOCK_TYPES.items()
    for k, n in zip(IN_FEATURES[kind.block_weights], (33, 17, 3), strict=True)
]
# The same source built otherwise: the two the kernels promise (no AVX-512; no AVX2 or FMA),
# and two more that GCC's tuning hides on this machine (512-bit vectors, none at all).
OTHER_BUILDS = {
    "avx2": ("-mno-avx512f",),
    "plain": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
    "zmm": ("-mprefer-vector-width=512",),
    "scalar": ("-fno-tree-vectorize", "-fno-tree-slp-vectorize"),
}


@pytest.fixture(scope="module", autouse=True)
def _kernels_built() -> None:
    """The C library must build here: a silent fallback would test the reference twice."""
    assert gguf_blocks.load_library() is not None


def random_fp16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """fp16 bit patterns (uint16) of every kind but inf and NaN, both signs, with a tenth of
    them SPECIAL_FP16 (zeros, subnormals, 65504)."""
    bits = rng.integers(0, 0x7C00, shape, dtype=np.uint16)
    bits |= rng.integers(0, 2, shape, dtype=np.uint16) << 15
    special = rng.random(shape) < 0.1
    bits[special] = rng.choice(SPECIAL_FP16, int(special.sum())).astype(np.uint16)
    return bits


def random_blocks(rng: np.random.Generator, kind: BlockType, n: int, k: int) -> np.ndarray:
    """A tensor's bytes as in a GGUF file, uint8 [n, row bytes]: random codes and packed
    sub-block scales, finite random fp16 scales (and F16 values)."""
    blocks = k // kind.block_weights
    cells = rng.integers(0, 256, (n, blocks, kind.block_bytes), dtype=np.uint8)
    if kind.name == "F16":
        cells[:] = random_fp16(rng, (n, blocks, kind.block_weights)).view(np.uint8)
    for offset in FP16_FIELDS.get(kind.name, ()):
        cells[..., offset : offset + 2] = random_fp16(rng, (n, blocks, 1)).view(np.uint8)
    return cells.reshape(n, -1)


def gguf_values(raw: np.ndarray, kind: BlockType) -> torch.Tensor:
    """gguf's own dequantisation of the rows ``raw``."""
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind.name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal as bit patterns: -0 is not 0, and a NaN must be the same NaN."""
    assert got.dtype == expected.dtype == torch.float32
    assert got.shape == expected.shape
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def block_rows(
    library: ctypes.CDLL, kind: BlockType, raw: np.ndarray, ids: torch.Tensor, threads: int = 1
) -> torch.Tensor:
    """``gguf_block_rows`` of ``library`` called directly."""
    k = raw.shape[1] // kind.block_bytes * kind.block_weights
    flat = ids.to(torch.int64).contiguous()
    out = torch.empty(len(flat), k)
    status = library.gguf_block_rows(
        kind.code, raw.ctypes.data, raw.shape[0], k, flat.data_ptr(), len(flat),
        out.data_ptr(), threads,
    )  # fmt: skip
    assert status == 0
    return out


@cache
def other_build(name: str) -> ctypes.CDLL:
    """The same source built with OTHER_BUILDS[name] added to its flags."""
    flags = (*gguf_blocks.FLAGS, *OTHER_BUILDS[name])
    library = load_c_library(gguf_blocks.SOURCE, flags, "another build", "the test fails")
    assert library is not None
    gguf_blocks.declare(library)
    return library


@pytest.mark.parametrize(("name", "k", "n"), CASES)
def test_every_row_equals_gguf_bit_for_bit(name: str, k: int, n: int) -> None:
    kind = BLOCK_TYPES[name]
    raw = random_blocks(np.random.default_rng(k + n), kind, n, k)
    expected = gguf_values(raw, kind)
    assert expected.shape == (n, k)
    for lookup in (dequantize_rows, dequantize_rows_reference):
        assert_same_bits(lookup(raw, kind, k, torch.arange(n)), expected)
    assert_same_bits(dequantize_rows(torch.from_numpy(raw), kind, k, torch.arange(n)), expected)


@pytest.mark.parametrize(("name", "k", "n"), CASES)
def test_looked_up_rows_equal_gguf_bit_for_bit(name: str, k: int, n: int) -> None:
    """Random ids with repeats, both ends, one id, none, 2-D ids, narrower integer ids."""
    kind = BLOCK_TYPES[name]
    rng = np.random.default_rng(2 * k + n)
    raw = random_blocks(rng, kind, n, k)
    expected = gguf_values(raw, kind)
    for ids in (
        torch.from_numpy(rng.integers(0, n, 40)),
        torch.tensor([n - 1, 0, n - 1, 0]),
        torch.tensor([n // 2]),
        torch.tensor([], dtype=torch.int64),
        torch.from_numpy(rng.integers(0, n, (3, 5))),
        torch.arange(n, dtype=torch.int32).flip(0).view(-1, 1),
    ):
        for lookup in (dequantize_rows, dequantize_rows_reference):
            got = lookup(raw, kind, k, ids)
            assert got.shape == (*ids.shape, k)
            assert_same_bits(got, expected[ids.long()])


def test_every_fp16_pattern_converts_as_numpy_does() -> None:
    """F16 values of all 65536 patterns: subnormals, infinities and NaN payloads included."""
    kind = block_type("F16")
    raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 64 * 2)
    ids = torch.arange(raw.shape[0])
    assert_same_bits(dequantize_rows(raw, kind, 64, ids), gguf_values(raw, kind))


@pytest.mark.parametrize("build", OTHER_BUILDS)
@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_each_instruction_set_gives_the_same_bits(build: str, name: str) -> None:
    """Built without AVX-512, without AVX2 and FMA, with 512-bit vectors or with none, the
    loops must give this machine's build's bits (where this CPU lacks an instruction set, that
    build is this machine's build itself)."""
    kind = BLOCK_TYPES[name]
    k = IN_FEATURES[kind.block_weights][-1]
    raw = random_blocks(np.random.default_rng(len(name)), kind, 24, k)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 24, 30))
    native = gguf_blocks.load_library()
    assert native is not None
    assert_same_bits(
        block_rows(other_build(build), kind, raw, ids), block_rows(native, kind, raw, ids)
    )


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("name", ["F16", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_the_thread_count_changes_no_bit(name: str) -> None:
    kind = BLOCK_TYPES[name]
    k = IN_FEATURES[kind.block_weights][1]
    raw = random_blocks(np.random.default_rng(3), kind, 200, k)
    ids = torch.from_numpy(np.random.default_rng(4).integers(0, 200, 100))  # > 16: threaded
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(dequantize_rows(raw, kind, k, ids))
    assert_same_bits(results[0], results[1])
    native = gguf_blocks.load_library()
    assert native is not None
    for threads in (0, 3):  # a nonsense count is taken as one thread
        assert_same_bits(block_rows(native, kind, raw, ids, threads), results[0])


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_the_registry_matches_gguf_and_the_c_table(name: str) -> None:
    """Sizes per block of 32 or 256 weights as in gguf (F32, F16, BF16: 32 values of 4, 2, 2
    bytes), and the C table's entry for the code."""
    kind = BLOCK_TYPES[name]
    weights, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    assert kind.block_weights % weights == 0
    assert kind.block_bytes == size * (kind.block_weights // weights)
    if weights == 1:
        assert (kind.block_weights, kind.block_bytes) == (32, {"F32": 128}.get(name, 64))
    else:
        assert kind.block_weights == weights
    native = gguf_blocks.load_library()
    assert native is not None
    block_weights, block_bytes = ctypes.c_int64(), ctypes.c_int64()
    assert (
        native.gguf_block_info(kind.code, ctypes.byref(block_weights), ctypes.byref(block_bytes))
        == 0
    )
    assert (block_weights.value, block_bytes.value) == (kind.block_weights, kind.block_bytes)


def test_the_codes_are_the_c_enum_order() -> None:
    assert [kind.code for kind in BLOCK_TYPES.values()] == list(range(len(BLOCK_TYPES)))
    native = gguf_blocks.load_library()
    assert native is not None
    unused = ctypes.c_int64()
    for code in (-1, len(BLOCK_TYPES)):
        assert native.gguf_block_info(code, ctypes.byref(unused), ctypes.byref(unused)) == -1


def test_the_c_function_refuses_and_writes_nothing() -> None:
    """-2 for an unknown type or a k off the block, -1 for an id outside [0, n) even after
    valid ones, and out untouched in each case."""
    native = gguf_blocks.load_library()
    assert native is not None
    kind = block_type("Q4_K")
    raw = random_blocks(np.random.default_rng(5), kind, 4, 256)
    out = torch.full((3, 256), 7.0)
    for code, k, ids, status in (
        (len(BLOCK_TYPES), 256, [0, 1, 2], -2),
        (kind.code, 128, [0, 1, 2], -2),
        (kind.code, 0, [0, 1, 2], -2),
        (kind.code, 256, [0, 1, 4], -1),
        (kind.code, 256, [0, -1, 1], -1),
    ):
        flat = torch.tensor(ids, dtype=torch.int64)
        assert native.gguf_block_rows(
            code, raw.ctypes.data, 4, k, flat.data_ptr(), 3, out.data_ptr(), 1
        ) == status  # fmt: skip
        assert bool((out == 7.0).all())


@pytest.mark.parametrize("lookup", [dequantize_rows, dequantize_rows_reference])
def test_a_bad_id_is_an_index_error_naming_the_range(
    lookup: Callable[..., torch.Tensor],
) -> None:
    kind = block_type("Q8_0")
    raw = random_blocks(np.random.default_rng(6), kind, 7, 64)
    for bad in (7, -1):  # past the end, and a wrapped index
        with pytest.raises(IndexError, match=r"row ids must lie in \[0, 7\)"):
            lookup(raw, kind, 64, torch.tensor([0, bad, 3]))
    with pytest.raises(ValueError, match="integer tensor"):
        lookup(raw, kind, 64, torch.tensor([0.0, 1.0]))


def test_bad_tensor_data_is_a_value_error() -> None:
    kind = block_type("Q4_K")
    raw = random_blocks(np.random.default_rng(7), kind, 5, 512)
    for bad in (raw[:, :-1], raw.view(np.int8), raw.reshape(-1), raw[:, :144]):
        with pytest.raises(ValueError, match="truncated or misaligned tensor data"):
            check_rows(bad, kind, 512)
        with pytest.raises(ValueError, match="truncated or misaligned tensor data"):
            dequantize_rows(bad, kind, 512, torch.tensor([0]))
    for k in (0, -256, 384, 500):
        with pytest.raises(ValueError, match="positive multiple of Q4_K's block of 256"):
            check_rows(raw, kind, k)
    with pytest.raises(ValueError, match="truncated or misaligned"):
        dequantize_rows(torch.from_numpy(raw).float(), kind, 512, torch.tensor([0]))
    check_rows(raw, kind, 512)  # the right shape passes


def test_an_unknown_type_is_a_value_error_listing_the_supported() -> None:
    with pytest.raises(ValueError, match=r"'IQ2_XXS' is not supported; supported: F32, .*IQ4_XS"):
        block_type("IQ2_XXS")
    assert block_type("q4_k") is BLOCK_TYPES["Q4_K"]
    with pytest.raises(ValueError, match="32 or 256 weights"):
        BlockType("Q9_9", 99, 64, 10)


def test_without_a_compiler_gguf_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gguf_blocks, "NATIVE", gguf_blocks.NATIVE.fresh())  # not built yet
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "/nonexistent/cc")
    kind = block_type("Q5_K")
    raw = random_blocks(np.random.default_rng(8), kind, 6, 512)
    ids = torch.tensor([[5, 0], [2, 2]])
    got = dequantize_rows(raw, kind, 512, ids)
    assert gguf_blocks.load_library() is None
    assert caplog.text.count("could not be built") == 1
    assert_same_bits(got, gguf_values(raw, kind)[ids])
    assert dequantize_rows(raw, kind, 512, torch.tensor([], dtype=torch.int64)).shape == (0, 512)
