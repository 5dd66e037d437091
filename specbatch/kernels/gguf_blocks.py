"""GGUF tensor blocks of every common type, dequantised (equal bit for bit to gguf's numpy)
and multiplied as stored in C.

A GGUF tensor is read as its bytes exactly as in the file: uint8 [N, K / W * B] for blocks of
W weights (32, or 256 for the K-quants and IQ4_XS) of B bytes (F32, F16 and BF16 taken as
blocks of 32 values). ``BLOCK_TYPES`` names the supported types by their ggml names;
``dequantize_rows`` is the embedding lookup over them, :class:`BlockWeight` the weight form
that multiplies float32 rows with them (layout, exactness and the summation order in
``gguf_blocks.c``). Where no compiler works the lookup takes ``gguf.quants.dequantize`` and
the product a dense copy, row by row (the same values, slower).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from specbatch.kernels.cbuild import NATIVE_FLAGS, NativeLibrary
from specbatch.kernels.weight_forms import FusedPart, add_bias, call_linear, check_float32_rows

SOURCE = Path(__file__).with_name("gguf_blocks.c")
FLAGS = (*NATIVE_FLAGS, "-ffp-contract=off")
_ID_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class BlockType:
    """A GGUF tensor type as the C library sees it: ``code`` its enum value in
    ``gguf_blocks.c``, and a block of ``block_weights`` weights stored in ``block_bytes``."""

    name: str
    code: int
    block_weights: int
    block_bytes: int

    def __post_init__(self) -> None:
        if self.block_weights not in (32, 256) or self.block_bytes <= 0:
            raise ValueError(
                f"{self.name}: blocks must hold 32 or 256 weights in a positive number of "
                f"bytes, got {self.block_weights} weights in {self.block_bytes} bytes"
            )

    def row_bytes(self, in_features: int) -> int:
        """The bytes of a row of ``in_features`` weights (a multiple of the block)."""
        return in_features // self.block_weights * self.block_bytes


# In gguf_blocks.c's enum order: the code is the position.
_SIZES = (
    ("F32", 32, 128),
    ("F16", 32, 64),
    ("BF16", 32, 64),
    ("Q4_0", 32, 18),
    ("Q4_1", 32, 20),
    ("Q5_0", 32, 22),
    ("Q5_1", 32, 24),
    ("Q8_0", 32, 34),
    ("Q2_K", 256, 84),
    ("Q3_K", 256, 110),
    ("Q4_K", 256, 144),
    ("Q5_K", 256, 176),
    ("Q6_K", 256, 210),
    ("IQ4_NL", 32, 18),
    ("IQ4_XS", 256, 136),
)
BLOCK_TYPES: dict[str, BlockType] = {
    name: BlockType(name, code, weights, size) for code, (name, weights, size) in enumerate(_SIZES)
}


def block_type(name: str) -> BlockType:
    """The supported type of ggml name ``name`` ("Q4_K", case-insensitive)."""
    kind = BLOCK_TYPES.get(name.upper())
    if kind is None:
        raise ValueError(
            f"GGUF tensor type {name!r} is not supported; supported: {', '.join(BLOCK_TYPES)}"
        )
    return kind


def check_rows(raw: np.ndarray, kind: BlockType, in_features: int) -> None:
    """Raise ``ValueError`` unless ``raw`` holds rows of ``in_features`` weights of ``kind``
    as in the file: uint8 [N, in_features / block_weights * block_bytes], ``in_features`` a
    positive multiple of the block. (The caller names the tensor.)"""
    if in_features <= 0 or in_features % kind.block_weights:
        raise ValueError(
            f"in_features must be a positive multiple of {kind.name}'s block of "
            f"{kind.block_weights} weights, got {in_features}"
        )
    width = kind.row_bytes(in_features)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != width:
        raise ValueError(
            f"truncated or misaligned tensor data: {kind.name} rows of {in_features} weights "
            f"must be uint8 [rows, {width}], got {raw.dtype} {list(raw.shape)}"
        )


def declare(library: ctypes.CDLL) -> None:
    """The C functions' signatures."""
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.gguf_block_info.restype = ctypes.c_int
    library.gguf_block_info.argtypes = [ctypes.c_int, pointer, pointer]  # type, weights, bytes
    library.gguf_block_rows.restype = ctypes.c_int
    library.gguf_block_rows.argtypes = [
        ctypes.c_int, pointer, i64, i64,  # type, data, N, K
        pointer, i64, pointer, ctypes.c_int,  # ids, count, out, threads
    ]  # fmt: skip
    library.gguf_block_linear.restype = ctypes.c_int
    library.gguf_block_linear.argtypes = [
        ctypes.c_int, pointer, i64, i64,  # type, x, rows, K
        pointer, i64, pointer, ctypes.c_int,  # weights, N, out, threads
    ]  # fmt: skip
    library.gguf_block_isa.restype = ctypes.c_int
    library.gguf_block_isa.argtypes = []


NATIVE = NativeLibrary(
    SOURCE,
    FLAGS,
    "the GGUF block kernels",
    "GGUF tensors are dequantised by gguf's numpy code instead (slow)",
    declare,
)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None where they cannot be built."""
    return NATIVE.load()


def _as_rows(raw: np.ndarray | torch.Tensor, kind: BlockType, in_features: int) -> np.ndarray:
    """``raw`` checked and as a C-contiguous numpy array (a torch tensor's memory, shared)."""
    array = raw.detach().cpu().numpy() if isinstance(raw, torch.Tensor) else raw
    check_rows(array, kind, in_features)
    return np.ascontiguousarray(array)


def _flat_ids(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """``ids`` as a contiguous int64 CPU vector, each checked to lie in [0, rows)."""
    if ids.dtype not in _ID_DTYPES:
        raise ValueError(f"row ids must be an integer tensor, got {ids.dtype}")
    flat = ids.detach().reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    bad = flat[(flat < 0) | (flat >= rows)]
    if bad.numel():
        raise IndexError(f"row ids must lie in [0, {rows}), got {bad[:8].tolist()}")
    return flat


def dequantize_rows(
    raw: np.ndarray | torch.Tensor, kind: BlockType, in_features: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows ``ids`` of the [N, in_features] tensor whose file bytes are ``raw`` (uint8
    [N, row bytes]; :func:`check_rows`), dequantised: float32 [*ids.shape, in_features],
    equal bit for bit to ``gguf.quants.dequantize``. By the C library, else by
    :func:`dequantize_rows_reference`. ``IndexError`` for an id outside [0, N)."""
    library = load_library()
    if library is None:
        return dequantize_rows_reference(raw, kind, in_features, ids)
    rows = _as_rows(raw, kind, in_features)
    flat = _flat_ids(ids, rows.shape[0])
    out = torch.empty(len(flat), in_features, dtype=torch.float32)
    status = library.gguf_block_rows(
        kind.code,
        rows.ctypes.data,
        rows.shape[0],
        in_features,
        flat.data_ptr(),
        len(flat),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:  # checked above: a registry entry out of step with the C table
        raise RuntimeError(f"gguf_block_rows refused {kind.name} (status {status})")
    return out.reshape(*ids.shape, in_features)


def dequantize_rows_reference(
    raw: np.ndarray | torch.Tensor, kind: BlockType, in_features: int, ids: torch.Tensor
) -> torch.Tensor:
    """:func:`dequantize_rows` by ``gguf.quants.dequantize`` (numpy): the C library's
    reference, and the lookup where it cannot be built."""
    rows = _as_rows(raw, kind, in_features)
    flat = _flat_ids(ids, rows.shape[0]).numpy()
    if not len(flat):  # (gguf has no empty case)
        return torch.empty(*ids.shape, in_features, dtype=torch.float32)
    values = gguf.quants.dequantize(rows[flat], gguf.GGMLQuantizationType[kind.name])
    dense = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return dense.reshape(*ids.shape, in_features)


VECTOR_ISAS = ("plain", "avx2", "avx512")  # by gguf_block_isa()'s code


def vector_isa() -> str | None:
    """The instruction set the built product multiplies with ("avx512", "avx2" with FMA,
    "plain"), or None where it cannot be built."""
    library = load_library()
    return None if library is None else VECTOR_ISAS[library.gguf_block_isa()]


class BlockWeight:
    """A [out_features, in_features] weight held as a GGUF tensor's bytes, as stored, of any
    type in ``BLOCK_TYPES``: multiplied with float32 rows in C (``gguf_block_linear``), its rows
    looked up for an embedding. Every weight is the file's value (gguf's dequantisation)."""

    def __init__(self, raw: np.ndarray | torch.Tensor, kind: BlockType, in_features: int) -> None:
        rows = _as_rows(raw, kind, in_features)  # whole blocks: K is a multiple of 32
        self.kind = kind
        self.in_features = in_features
        self.out_features = rows.shape[0]
        self.data = torch.from_numpy(rows.copy())  # owned: the file map may close

    @classmethod
    def from_blocks(cls, raw: np.ndarray, type_name: str, in_features: int) -> BlockWeight:
        """From a tensor's bytes (uint8 [N, row bytes]) of ggml type ``type_name``."""
        return cls(raw, block_type(type_name), in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantised rows ``ids`` (an embedding lookup): float32 [*ids.shape, K]."""
        return dequantize_rows(self.data, self.kind, self.in_features, ids)

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight, equal bit for bit to gguf's dequantisation."""
        return self.rows(torch.arange(self.out_features))

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return add_bias(block_linear(x, self), bias)

    def fused_part(self) -> FusedPart | None:
        """``gguf_block_linear``, the function :func:`block_linear` calls."""
        library = load_library()
        if library is None:
            return None
        linear = ctypes.cast(library.gguf_block_linear, ctypes.c_void_p).value or 0
        return FusedPart(linear, self.kind.code, self.data.data_ptr(), torch.float32)


def block_linear(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """``x @ weight.dequantize().T`` for float32 CPU rows ``x`` [M, K] (M may be 0): float32
    [M, N], each output summed in the fixed order of ``gguf_blocks.c``."""
    check_float32_rows(x, weight.in_features)
    library = load_library()
    if library is None:  # one matrix-vector product per row: still independent of the batch
        dense = weight.dequantize()
        return torch.stack([torch.mv(dense, row) for row in x]) if len(x) else x @ dense.T
    return run_block_kernel(library, x.contiguous(), weight)


def run_block_kernel(library: ctypes.CDLL, x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """``gguf_block_linear`` of ``library`` on contiguous float32 ``x`` [M, K]."""
    kernel = library.gguf_block_linear
    out, status = call_linear(kernel, weight.kind.code, x, weight.data, weight.out_features)
    if status == -1:
        raise MemoryError("the GGUF block kernel could not allocate its scratch memory")
    if status != 0:
        raise RuntimeError(f"gguf_block_linear refused {weight.kind.name} (status {status})")
    return out
