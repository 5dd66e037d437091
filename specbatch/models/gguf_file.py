"""A fast GGUF container parser: metadata, tensor directory, and dequantised tensor data.

``gguf.GGUFReader`` builds a numpy view per metadata string, which costs ~9 s for a 49k-token
vocabulary; this parser reads the same layout with ``struct`` in a fraction of a second and leaves
dequantisation to the ``gguf`` package. Layout (little-endian): magic ``GGUF``, version, tensor
count, metadata count, the metadata key/value pairs, the tensor infos, padding to the alignment,
then the tensor data.
"""

from __future__ import annotations

import itertools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specbatch.errors import ModelLoadError
from specbatch.utils import ceil_div

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_NUMPY_OF = {code: np.dtype(fmt) for code, fmt in _SCALARS.items()}
# The fewest bytes one value of each kind takes: a count that could not fit in the bytes left is
# refused before a loop tries to read that many (a string is a u64 length, an array a u32 kind
# and a u64 count).
_MIN_SIZE = {
    **{code: struct.calcsize(fmt) for code, fmt in _SCALARS.items()},
    _STRING: 8,
    _ARRAY: 12,
}
_MIN_KV_SIZE = 8 + 4 + 1  # key length, value kind, one byte of value
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_INT64_LIMIT = 2**63  # ggml holds dimensions and element counts in int64


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: GGUF's dimensions reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"


class _Cursor:
    def __init__(self, data: Any) -> None:
        self.data = data
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        raw = self.data[self.pos : self.pos + length]
        if len(raw) != length:
            raise ValueError("string runs past the end of the file")
        self.pos += length
        return bytes(raw).decode("utf-8", errors="replace")

    def expect(self, count: int, item_size: int, what: str) -> None:
        """Refuse ``count`` items of at least ``item_size`` bytes that cannot fit in the file."""
        if count * item_size > len(self.data) - self.pos:
            raise ValueError(f"{count} {what} run past the end of the file")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind not in _MIN_SIZE:
                raise ValueError(f"unknown metadata array item type {item_kind}")
            self.expect(count, _MIN_SIZE[item_kind], "array items")
            if item_kind in _NUMPY_OF:  # numeric arrays in one read
                dtype = _NUMPY_OF[item_kind]
                array = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return array.tolist()
            return [self.value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind}")


def _read_tensor_info(cursor: _Cursor) -> tuple[str, list[int], int, int]:
    name = cursor.string()
    num_dims = cursor.scalar("<I")
    if num_dims > _MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {num_dims} dimensions (at most {_MAX_DIMS})")
    dims = [cursor.scalar("<Q") for _ in range(num_dims)]
    return name, dims, cursor.scalar("<I"), cursor.scalar("<Q")


def _alignment(metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"general.alignment must be a positive integer, got {alignment!r}")
    if alignment & (alignment - 1):
        raise ValueError(f"general.alignment must be a power of two, got {alignment}")
    return alignment


def _check_unique_names(tensors: list[GGUFTensorInfo]) -> None:
    seen: set[str] = set()
    for tensor in tensors:
        if tensor.name in seen:
            raise ValueError(f"tensor {tensor.name!r} is declared twice")
        seen.add(tensor.name)


class GGUFFile:
    """The metadata and tensor directory of a GGUF file; tensor data is memory-mapped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such GGUF file")
        try:
            with path.open("rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read file: {exc}") from None
        try:
            self.metadata, self.tensors = self._parse()
        # RecursionError: arrays nested thousands deep (legal in the format, never in a model).
        except (ValueError, struct.error, UnicodeDecodeError, RecursionError) as exc:
            raise ModelLoadError(
                f"{path}: not a valid GGUF file (truncated or corrupt?): {exc}"
            ) from None

    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
        cursor = _Cursor(self._map)
        if bytes(self._map[:4]) != b"GGUF":
            raise ValueError("missing GGUF magic bytes")
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
        cursor.expect(kv_count, _MIN_KV_SIZE, "metadata entries")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"))
        cursor.expect(tensor_count, _MIN_TENSOR_INFO_SIZE, "tensor infos")
        raw_infos = [_read_tensor_info(cursor) for _ in range(tensor_count)]
        alignment = _alignment(metadata)
        data_start = ceil_div(cursor.pos, alignment) * alignment
        tensors = [self._tensor_info(data_start, *raw) for raw in raw_infos]
        _check_unique_names(tensors)
        return metadata, tensors

    def _tensor_info(
        self, data_start: int, name: str, dims: list[int], kind: int, offset: int
    ) -> GGUFTensorInfo:
        import gguf

        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type {kind}") from None
        shape = tuple(reversed(dims))  # numpy order, as the error messages show it
        if not all(1 <= d < _INT64_LIMIT for d in dims):
            raise ValueError(
                f"tensor {name!r} has shape {shape}: every dimension must be in [1, 2**63)"
            )
        count = math.prod(dims)  # exact: numpy's int64 product would wrap around silently
        if count >= _INT64_LIMIT:
            raise ValueError(f"tensor {name!r} has shape {shape}: its element count overflows")
        row = dims[0] if dims else 1
        if row % block:  # ggml quantises each row on its own
            raise ValueError(
                f"tensor {name!r} has shape {shape}: rows of {row} elements are not a whole "
                f"number of {block}-element blocks"
            )
        info = GGUFTensorInfo(name, shape, kind, data_start + offset, count // block * type_size)
        if info.offset + info.nbytes > len(self._map):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        return info

    def close(self) -> None:
        """Unmap the file (its pages otherwise stay resident as long as the object lives)."""
        self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_disjoint(self) -> None:
        """Refuse tensors that share bytes. Each tensor already fits in the file; disjoint, they
        also fit all together, which bounds the memory a model built from them can take however
        large the shapes the header claims. (The loader calls this after the shapes are checked
        against the config, so that a changed dimension is reported as such.)"""
        ordered = sorted(self.tensors, key=lambda t: t.offset)
        for before, after in itertools.pairwise(ordered):
            if before.offset + before.nbytes > after.offset:
                raise ModelLoadError(
                    f"{self.path}: tensors {before.name!r} and {after.name!r} overlap in the file "
                    f"(the header's offsets or shapes are corrupt)"
                )

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw_rows(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as stored, one row of blocks per output row: uint8 [rows, bytes]
        (a read-only view of the file map; copy it before the file is closed)."""
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return raw.reshape(rows, info.nbytes // rows)

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as a float32 array in numpy order, whatever its storage type."""
        import gguf

        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = raw.reshape(-1, info.shape[-1] // block * type_size) if info.shape else raw
        try:
            values = gguf.quants.dequantize(rows, qtype)
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.path}: tensor {info.name!r} uses {info.type_name}, which cannot be "
                "dequantised"
            ) from None
        return np.asarray(values, dtype=np.float32).reshape(info.shape)
