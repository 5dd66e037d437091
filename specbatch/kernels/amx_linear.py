"""bfloat16 linears on AMX tiles (``amx_linear.c``), where the CPU has them and Linux grants them.

The bfloat16 mode's layers run as one C call (``kernels/fused_layers.py``) only if C can call
its products, and a row's bits must not depend on its batch: torch exports neither oneDNN's C
API nor a row-invariant bfloat16 GEMM (MKL's ``cblas_gemm_bf16bf16f32`` is not). This kernel
is both: TDPBF16PS over tiles, every output summed over K in the same order at any row count,
rounded to bfloat16 in C (``amx_linear_bf16``: the per-op path and the fused layer call the
same function). Against oneDNN's bfloat16 linear, each product alone: 1.1-3x faster up to 64
rows, 0.75-1.0x at 256 (``python benchmarks/amx_bf16.py``, docs/notes.md 2026-12-06).
Without AMX, bfloat16 weights keep oneDNN's layout (``kernels.linear``).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from specbatch.kernels.cbuild import NATIVE_FLAGS, NativeLibrary
from specbatch.kernels.weight_forms import FusedPart, add_bias

SOURCE = Path(__file__).with_name("amx_linear.c")
TILE_K = 32  # bfloat16 values of K per tile: in_features must be a multiple
_TILE_VALUES = 512  # bfloat16 values per B tile (16 outputs x 32 K)


def _declare(library: ctypes.CDLL) -> None:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.amx_available.restype = ctypes.c_int
    library.amx_available.argtypes = []
    library.pack_b.restype = None
    library.pack_b.argtypes = [pointer, i64, i64, pointer]
    library.amx_linear_bf16.restype = ctypes.c_int
    library.amx_linear_bf16.argtypes = [pointer, i64, i64, pointer, i64, pointer, ctypes.c_int]


NATIVE = NativeLibrary(
    SOURCE, NATIVE_FLAGS, "the AMX bfloat16 linear kernel", "bfloat16 stays oneDNN's", _declare
)


@functools.cache
def available() -> bool:
    """Whether bfloat16 products can run on AMX tiles here (the kernel built with AMX and the
    tile state granted by Linux); settled once per process."""
    library = NATIVE.load()
    return library is not None and bool(library.amx_available())


@dataclass(frozen=True)
class TileWeight:
    """A bfloat16 ``[out_features, in_features]`` weight as TDPBF16PS's B tiles."""

    data: torch.Tensor  # int16: the tiles' bfloat16 bits
    out_features: int
    in_features: int

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether ``weight`` can be held as AMX tiles here."""
        return (
            weight.dtype == torch.bfloat16
            and weight.dim() == 2
            and weight.shape[1] % TILE_K == 0
            and available()
        )

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> TileWeight:
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        if (
            weight.dtype != torch.bfloat16
            or weight.dim() != 2
            or weight.device.type != "cpu"
            or k % TILE_K
        ):
            raise ValueError(
                f"AMX tiles hold a 2-D bfloat16 CPU matrix with a multiple of {TILE_K} "
                f"columns, not {weight.dtype} {tuple(weight.shape)} on {weight.device}"
            )
        library = NATIVE.load()
        if library is None or not available():
            raise RuntimeError("AMX tiles are not available on this machine")
        weight = weight.detach().contiguous()
        data = torch.empty(-(-n // 16) * (k // TILE_K) * _TILE_VALUES, dtype=torch.int16)
        library.pack_b(weight.data_ptr(), n, k, data.data_ptr())
        return cls(data, n, k)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return add_bias(amx_linear(x, self), bias)

    def fused_part(self) -> FusedPart | None:
        """``amx_linear_bf16`` (bfloat16 rows in and out), the function :func:`amx_linear`
        calls."""
        linear = linear_address()
        return FusedPart(linear, 0, self.data.data_ptr(), torch.bfloat16) if linear else None


def amx_linear(x: torch.Tensor, weight: TileWeight) -> torch.Tensor:
    """``x @ W^T`` for bfloat16 rows ``x`` ``[..., in_features]``: summed in float32, each
    output rounded to bfloat16."""
    if x.dtype != torch.bfloat16 or x.shape[-1] != weight.in_features:
        raise ValueError(
            f"expected bfloat16 rows of {weight.in_features}, got {x.dtype} {tuple(x.shape)}"
        )
    library = NATIVE.load()
    assert library is not None, "TileWeight exists only where the library does"
    rows = x.reshape(-1, weight.in_features).contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.bfloat16)
    status = library.amx_linear_bf16(
        rows.data_ptr(),
        rows.shape[0],
        weight.in_features,
        weight.data.data_ptr(),
        weight.out_features,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the AMX linear kernel could not allocate its scratch memory")
    return out.reshape(*x.shape[:-1], weight.out_features)


def linear_address() -> int:
    """``amx_linear_bf16``'s address (for the fused bfloat16 layer), or 0 without it."""
    library = NATIVE.load()
    if library is None or not available():
        return 0
    return ctypes.cast(library.amx_linear_bf16, ctypes.c_void_p).value or 0
