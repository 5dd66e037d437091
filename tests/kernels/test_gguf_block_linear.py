"""Products with GGUF blocks of every type as stored (``gguf_blocks.BlockWeight``): against
float64 with gguf's own values, a row's bits independent of its batch, the thread count and
the instruction set (registers for a few rows, a scratch tile for more, plain C), the same
bits as the repacked Q4_1/Q8_0 kernel, and the dense fallback where no compiler works."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.kernels import gguf_blocks
from specbatch.kernels.cbuild import load_c_library
from specbatch.kernels.gguf_blocks import BLOCK_TYPES, BlockType, BlockWeight, block_linear
from specbatch.kernels.gguf_linear import QuantizedWeight
from tests.kernels.test_gguf_blocks import gguf_values, random_blocks

# (K, N) per block size: N off the 16-output tiles and the 4-output register blocks
SHAPES = {32: [(96, 7), (640, 37)], 256: [(256, 5), (1024, 33)]}
ROW_COUNTS = [1, 2, 3, 4, 5, 8, 17, 70]  # in registers up to 4 (AVX-512) or 2, then tiles


@pytest.fixture(scope="module", autouse=True)
def _kernels_built() -> None:
    assert gguf_blocks.load_library() is not None


def finite_blocks(kind: BlockType, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks whose values are all finite (F32 and BF16 from normal samples)."""
    rng = np.random.default_rng(seed)
    if kind.name in ("F32", "BF16"):
        values = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
        stored = values if kind.name == "F32" else values.bfloat16()
        return stored.contiguous().view(torch.uint8).numpy().reshape(n, -1)
    return random_blocks(rng, kind, n, k)


def weight_of(name: str, k: int, n: int, seed: int = 0) -> BlockWeight:
    return BlockWeight.from_blocks(finite_blocks(BLOCK_TYPES[name], n, k, seed), name, k)


def assert_near_product(got: torch.Tensor, x: torch.Tensor, weight: BlockWeight) -> None:
    """Within float32 summation error of the float64 product with gguf's values, relative to
    sum |x| |w| (the terms span fp16's whole range)."""
    raw = weight.data.numpy()
    dense = gguf_values(raw, weight.kind).double()
    error = (got.double() - x.double() @ dense.T).abs()
    assert bool((error <= 1e-5 * (x.double().abs() @ dense.abs().T) + 1e-30).all())


CASES = [
    pytest.param(name, k, n, id=f"{name}-{n}x{k}")
    for name, kind in BLOCK_TYPES.items()
    for k, n in SHAPES[kind.block_weights]
]


@pytest.mark.parametrize(("name", "k", "n"), CASES)
def test_products_match_float64_and_keep_a_rows_bits(name: str, k: int, n: int) -> None:
    weight = weight_of(name, k, n, seed=k + n)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(n))
    full = block_linear(x, weight)
    assert full.shape == (70, n)
    assert full.dtype == torch.float32
    assert_near_product(full, x, weight)
    assert torch.equal(weight.dequantize(), gguf_values(weight.data.numpy(), weight.kind))
    for m in ROW_COUNTS:  # every row count's path gives each row the bits it has alone
        parts = torch.cat([block_linear(part, weight) for part in x.split(m)])
        assert torch.equal(parts, full), m


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0", "Q6_K", "IQ4_XS", "F16"])
@pytest.mark.usefixtures("two_threads")
def test_the_thread_count_changes_no_bit(name: str) -> None:
    k = 512
    weight = weight_of(name, k, 200)
    x = torch.randn(30, k, generator=torch.Generator().manual_seed(2))
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append([block_linear(x[:m], weight) for m in (1, 3, 30)])
    for other in results[1:]:
        for one, two in zip(results[0], other, strict=True):
            assert torch.equal(one, two)


@pytest.mark.parametrize(
    "disabled",
    [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma")],
    ids=["avx2", "plain"],
)
def test_each_instruction_set_gives_the_same_bits(disabled: tuple[str, ...]) -> None:
    """Built without AVX-512 the product takes its AVX2 path, without AVX2 its plain C path:
    each the same bits as this machine's build, for every type and row count."""
    other = load_c_library(
        gguf_blocks.SOURCE, (*gguf_blocks.FLAGS, *disabled), "a reduced build", "test fails"
    )
    assert other is not None
    gguf_blocks.declare(other)
    native = gguf_blocks.vector_isa()
    expected = "plain" if "-mno-avx2" in disabled or native == "plain" else "avx2"
    assert gguf_blocks.VECTOR_ISAS[other.gguf_block_isa()] == expected
    for name, kind in BLOCK_TYPES.items():
        k, n = SHAPES[kind.block_weights][1]
        weight = weight_of(name, k, n, seed=3)
        x = torch.randn(12, k, generator=torch.Generator().manual_seed(3))
        for m in (1, 2, 3, 4, 5, 12):
            got = gguf_blocks.run_block_kernel(other, x[:m].contiguous(), weight)
            assert torch.equal(got, block_linear(x[:m], weight)), (name, m)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_the_same_bits_as_the_repacked_kernel(name: str) -> None:
    """One summation order for every block kernel: the file's Q4_1/Q8_0 bytes multiplied as
    stored equal the repacked kernel's products (``gguf_linear``) bit for bit."""
    raw = finite_blocks(BLOCK_TYPES[name], 37, 640, seed=5)
    stored = BlockWeight.from_blocks(raw, name, 640)
    repacked = QuantizedWeight.from_blocks(raw, name.lower(), 640)
    x = torch.randn(70, 640, generator=torch.Generator().manual_seed(5))
    for m in (1, 2, 5, 70):
        assert torch.equal(stored.multiply(x[:m]), repacked.multiply(x[:m])), m


def test_no_rows_a_bias_and_refused_inputs() -> None:
    weight = weight_of("Q4_K", 256, 5)
    assert block_linear(torch.empty(0, 256), weight).shape == (0, 5)
    x = torch.randn(3, 256)
    bias = torch.randn(5)
    assert torch.equal(weight.multiply(x, bias), block_linear(x, weight) + bias)
    wide = torch.randn(3, 512)
    assert torch.equal(
        block_linear(wide[:, ::2], weight), block_linear(wide[:, ::2].clone(), weight)
    )
    for bad in (torch.randn(3, 256).double(), torch.randn(3, 128), torch.randn(256)):
        with pytest.raises(ValueError, match="x must be float32"):
            block_linear(bad, weight)
    with pytest.raises(ValueError, match="truncated or misaligned"):
        BlockWeight.from_blocks(weight.data.numpy()[:, :-1], "Q4_K", 256)
    with pytest.raises(ValueError, match="not supported"):
        BlockWeight.from_blocks(weight.data.numpy(), "Q9_9", 256)


def test_the_form_owns_its_bytes_and_names_its_kernel() -> None:
    raw = finite_blocks(BLOCK_TYPES["Q6_K"], 9, 512, seed=6)
    weight = BlockWeight.from_blocks(raw, "Q6_K", 512)
    raw[:] = 0  # the file map may close: the form keeps a copy
    assert weight.nbytes == 9 * 2 * 210
    part = weight.fused_part()
    assert part is not None
    assert part.kind == BLOCK_TYPES["Q6_K"].code
    assert part.data == weight.data.data_ptr()
    assert part.activation == torch.float32
    ids = torch.tensor([[8, 0], [3, 3]])
    assert torch.equal(weight.rows(ids), weight.dequantize()[ids])


def test_without_a_compiler_the_dense_fallback_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    weight = weight_of("Q5_K", 256, 21)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(gguf_blocks, "NATIVE", gguf_blocks.NATIVE.fresh())
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    got = block_linear(x, weight)
    assert gguf_blocks.load_library() is None
    assert weight.fused_part() is None
    assert_near_product(got, x, weight)
    assert torch.equal(block_linear(x[2:3], weight), got[2:3])
