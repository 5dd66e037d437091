"""GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, IQ4_NL and IQ4_XS weights multiplied on AMX
tiles (``gguf_amx.c``), where the CPU has them and Linux grants them: the exact mode's form for
those types there (Q6_K, Q2_K and Q3_K, whose scales come per 16 weights, stay in
``gguf_blocks``).

Each product keeps the file's values: a block's integer codes are bfloat16 values, a float32
activation is exactly three bfloat16 parts, and a block's integer sum is TDPBF16PS over the
parts (every product exact, the sums float32), then scaled by the block's ``d`` (and offset by
``m`` times the block's sum of the activations) in float32, block by block (a K-quant's sub-
blocks of 32 are its blocks here, with ``d = d_super * sc`` and ``m = -dmin * m_sub``). A tile
multiplies up to 16 rows at the cost of one, so verify rows and batches cost little more than a
decode; a row's bits are the same at any row count and thread count. Against the panel kernel
(``gguf_linear``), SmolLM2-135M's 120 layer products: about level at one row, 1.3x at 5, 1.5-1.9x
at 16-64 (``python benchmarks/gguf_linear.py``; docs/notes.md, 2026-12-07 stop 64). Elsewhere
the panel kernel holds them.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specbatch.kernels.cbuild import NATIVE_FLAGS, NativeLibrary
from specbatch.kernels.gguf_blocks import block_type, check_rows
from specbatch.kernels.gguf_linear import BLOCK, quantize_q8_0
from specbatch.kernels.weight_forms import FusedPart, add_bias, call_linear, check_float32_rows

SOURCE = Path(__file__).with_name("gguf_amx.c")
FLAGS = (*NATIVE_FLAGS, "-ffp-contract=off")
TILE_N = 16  # outputs per record column
# ggml type (lower case) -> gguf_amx.c's kind code
_KIND = {
    "q4_1": 0,
    "q8_0": 1,
    "q4_0": 2,
    "q5_0": 3,
    "q5_1": 4,
    "q4_k": 5,
    "q5_k": 6,
    "iq4_nl": 7,
    "iq4_xs": 8,
}
TILED_TYPES = frozenset(name.upper() for name in _KIND)


def _declare(library: ctypes.CDLL) -> None:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.gguf_amx_available.restype = ctypes.c_int
    library.gguf_amx_available.argtypes = []
    library.gguf_amx_record_bytes.restype = i64
    library.gguf_amx_record_bytes.argtypes = [ctypes.c_int]
    library.gguf_amx_pack.restype = ctypes.c_int
    library.gguf_amx_pack.argtypes = [ctypes.c_int, pointer, i64, i64, pointer]
    library.gguf_amx_rows.restype = ctypes.c_int
    library.gguf_amx_rows.argtypes = [ctypes.c_int, pointer, i64, i64, pointer, i64, pointer]
    library.gguf_amx_linear.restype = ctypes.c_int
    library.gguf_amx_linear.argtypes = [
        ctypes.c_int, pointer, i64, i64,  # kind, x, rows, K
        pointer, i64,  # weights, N
        pointer, ctypes.c_int,  # out, threads
    ]  # fmt: skip


NATIVE = NativeLibrary(
    SOURCE,
    FLAGS,
    "the AMX GGUF block kernel",
    "Q4_1 / Q8_0 weights stay in the panel kernel",
    _declare,
)


@functools.cache
def available() -> bool:
    """Whether Q4_1 / Q8_0 products can run on AMX tiles here (the kernel built with AMX and
    the tile state granted by Linux); settled once per process."""
    library = NATIVE.load()
    return library is not None and bool(library.gguf_amx_available())


def _library() -> ctypes.CDLL:
    library = NATIVE.load()
    if library is None or not available():
        raise RuntimeError("the AMX GGUF block kernel is not available on this machine")
    return library


@dataclass(frozen=True, eq=False)
class TileBlockWeight:
    """A ``[out_features, in_features]`` weight of one of ``TILED_TYPES`` as records of 16
    outputs x 32 K in TDPBF16PS's B order (layout in ``gguf_amx.c``): the file's bytes
    rearranged (fp16 scales kept; a K-quant's sub-block scales as float32 products)."""

    kind: str
    in_features: int
    out_features: int
    data: torch.Tensor  # uint8 [ceil(N / 16) * K / 32 * record bytes]

    @classmethod
    def from_blocks(cls, raw: np.ndarray, kind: str, in_features: int) -> TileBlockWeight:
        """From a tensor's bytes as in the file: uint8 [N, row bytes] (K = ``in_features``, a
        multiple of the type's block); ``kind`` is a type of ``TILED_TYPES`` in lower case."""
        if kind not in _KIND:
            raise ValueError(f"kind must be one of {sorted(_KIND)}, got {kind!r}")
        check_rows(raw, block_type(kind), in_features)
        library = _library()
        n = raw.shape[0]
        record = library.gguf_amx_record_bytes(_KIND[kind])
        data = torch.empty(-(-n // TILE_N) * (in_features // BLOCK) * record, dtype=torch.uint8)
        raw = np.ascontiguousarray(raw)
        status = library.gguf_amx_pack(
            _KIND[kind], raw.ctypes.data, n, in_features, data.data_ptr()
        )
        if status != 0:
            raise ValueError(f"the AMX kernel cannot pack {kind}")
        return cls(kind, in_features, n, data)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> TileBlockWeight:
        """``weight`` [N, K] (K a multiple of 32) quantized to Q8_0 as ggml does."""
        array = weight.detach().to(torch.float32).cpu().numpy()
        return cls.from_blocks(quantize_q8_0(array), "q8_0", weight.shape[1])

    @property
    def nbytes(self) -> int:
        """Resident bytes."""
        return self.data.numel()

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return add_bias(tile_block_linear(x, self), bias)

    def fused_part(self) -> FusedPart | None:
        """``gguf_amx_linear``, the function :func:`tile_block_linear` calls."""
        linear = ctypes.cast(_library().gguf_amx_linear, ctypes.c_void_p).value or 0
        return FusedPart(linear, _KIND[self.kind], self.data.data_ptr(), torch.float32)

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight, equal bit for bit to gguf's dequantisation."""
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantised rows ``ids`` (an embedding lookup): float32 [*ids.shape, K]."""
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
        out = torch.empty(len(flat), self.in_features, dtype=torch.float32)
        status = _library().gguf_amx_rows(
            _KIND[self.kind],
            self.data.data_ptr(),
            self.out_features,
            self.in_features,
            flat.data_ptr(),
            len(flat),
            out.data_ptr(),
        )
        if status != 0:
            raise IndexError(f"row ids must lie in [0, {self.out_features}), got {ids.tolist()}")
        return out.reshape(*ids.shape, self.in_features).to(ids.device)


def tile_block_linear(x: torch.Tensor, weight: TileBlockWeight) -> torch.Tensor:
    """``x @ weight.dequantize().T`` for float32 ``x`` [M, K] on the CPU (M may be 0)."""
    check_float32_rows(x, weight.in_features)
    if x.shape[0] == 0:
        return torch.empty(0, weight.out_features, dtype=torch.float32)
    kernel = _library().gguf_amx_linear
    out, status = call_linear(
        kernel, _KIND[weight.kind], x.contiguous(), weight.data, weight.out_features
    )
    if status == 1:
        raise MemoryError("the AMX GGUF block kernel could not allocate its scratch memory")
    if status != 0:
        raise RuntimeError(f"gguf_amx_linear refused {weight.kind} (status {status})")
    return out
