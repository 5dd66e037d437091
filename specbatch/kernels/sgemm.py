"""Float32 products through MKL's packed GEMM, which torch's x86 builds carry and export.

A float32 weight is packed once (``cblas_sgemm_pack``, MKL's own layout of ``W^T``) and every
product is one ``cblas_sgemm_compute`` call, reached through ctypes from Python (the per-op
path) or by address from C (``cpu_ops.sgemm_linear``, the fused layers of
``kernels/fused_layers.py``): the same function with the same arguments, so the same bits.

Why MKL and not oneDNN's packed linear (``kernels.linear``) for float32: SmolLM2's 120 layer
products, weights streaming from memory (``python benchmarks/linear_rows.py 1 2 8 64 256`` on
a 2-core Intel Xeon with AVX-512, 2026-12-06; not yet measured on an AMD host, where MKL may
take slower paths): 15.2 / 17.4 / 24.0 / 61.5 / 205.6 ms at 1 / 2 / 8 / 64 / 256 rows
against oneDNN's 20.8 / 19.1 / 24.0 / 71.8 / 186.5 (faster to 64 rows, 10% slower at 256).
A row's bits do not depend on how many rows share the product (1 .. 700 rows, any offset, 1
or 2 threads: probed at load by :func:`_probe` and tested in ``tests/kernels/test_sgemm.py``),
so one row needs no second row as oneDNN's does; and C can call it, so a float32 layer runs as
one C call like a GGUF one.

Where the symbols are missing (torch builds without MKL: ARM, some source builds) or the probe
fails, :func:`available` is False and float32 weights keep oneDNN's layout.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specbatch.kernels import cpu_ops
from specbatch.kernels.weight_forms import FusedPart, add_bias

logger = logging.getLogger("specbatch")

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162

# The row count MKL lays the packed matrix out for (any count multiplies with it; a row's bits
# are the same at every count for a given layout). Measured, gate/up 3072x576 on a 2-core
# Intel Xeon (AVX-512): 256 rows take 2.55 ms packed for 256, 3.57 ms packed for 8 (oneDNN
# 2.79); 1 and 8 rows ~120 us either way.
_PACK_ROWS = 256


def _torch_library() -> ctypes.CDLL | None:
    """torch's CPU library with MKL's packed-GEMM functions declared, or None without them."""
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / name
        if not path.exists():
            continue
        try:
            library = ctypes.CDLL(str(path))
            size, pack, compute = (
                library.cblas_sgemm_pack_get_size,
                library.cblas_sgemm_pack,
                library.cblas_sgemm_compute,
            )
        except (OSError, AttributeError):
            return None
        c_int, c_float, pointer = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        size.restype = ctypes.c_size_t
        size.argtypes = [c_int, c_int, c_int, c_int]
        pack.restype = None
        pack.argtypes = [c_int] * 6 + [c_float, pointer, c_int, pointer]
        compute.restype = None
        compute.argtypes = [c_int] * 6 + [pointer, c_int, pointer, c_int, c_float, pointer, c_int]
        return library
    return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """torch's library where MKL's packed GEMM is exported and passes :func:`_probe`, else
    None; settled once per process."""
    library = _torch_library()
    return library if library is not None and _probe(library) else None


def available() -> bool:
    """Whether float32 products can go through MKL's packed GEMM here."""
    return _library() is not None


def _probe(library: ctypes.CDLL) -> bool:
    """Products of 260 rows against float64, and their first rows alone in the counts of
    decoding and verifying (1 .. 17) and a small prefill (64): each row's bits the same at
    every count, for a tall and a wide matrix (K = 1536 as SmolLM2's down projection; N = 1024
    with K = 576 as its q/k/v); ~10 ms."""
    generator = torch.Generator().manual_seed(0)
    for n, k in ((64, 1536), (1024, 576)):
        weight = torch.randn(n, k, generator=generator)
        x = torch.randn(260, k, generator=generator)
        packed = _pack(library, weight)
        full = _multiply(library, x, packed, n)
        expected = (x.double() @ weight.double().T).float()
        ok = torch.allclose(full, expected, rtol=1e-4, atol=1e-3) and all(
            torch.equal(_multiply(library, x[:m].clone(), packed, n), full[:m])
            for m in (1, 2, 3, 5, 8, 17, 64)
        )
        if not ok:
            logger.info(
                "MKL's packed GEMM failed its probe (%dx%d): float32 weights stay in oneDNN's "
                "layout",
                n,
                k,
            )
            return False
    return True


@dataclass(frozen=True)
class SgemmWeight:
    """A float32 ``[out_features, in_features]`` weight in MKL's packed layout."""

    data: torch.Tensor  # uint8, MKL's bytes
    out_features: int
    in_features: int

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether ``weight`` is held in MKL's packed layout here (float32, where available),
        but for a single output (Qwen2-MoE's shared-expert gate): MKL multiplies a one-column
        product in an order that depends on the rows beside it (23 rows together against one
        by one, 2026-12-06, Intel AVX-512 host), oneDNN's layout does not."""
        return (
            weight.dtype == torch.float32
            and weight.dim() == 2
            and weight.shape[0] > 1
            and available()
        )

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> SgemmWeight:
        library = _library()
        if library is None:
            raise RuntimeError("MKL's packed GEMM is not available in this torch build")
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(
                f"a packed GEMM weight is a 2-D float32 CPU matrix, not {weight.dtype} "
                f"{tuple(weight.shape)} on {weight.device}"
            )
        return cls(_pack(library, weight), weight.shape[0], weight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return add_bias(sgemm_linear(x, self), bias)

    def fused_part(self) -> FusedPart | None:
        """``cpu_ops.sgemm_linear``, which calls ``cblas_sgemm_compute`` with the arguments
        :func:`sgemm_linear` passes it (so the same bits)."""
        linear = _fused_linear()
        if not linear:
            return None
        return FusedPart(linear, 0, self.data.data_ptr(), torch.float32)


@functools.cache
def _fused_linear() -> int:
    """``cpu_ops.sgemm_linear``'s address, its MKL function handed over; 0 where either
    library is missing."""
    library, compute = cpu_ops.load_library(), compute_address()
    if library is None or not compute:
        return 0
    library.set_sgemm_compute(compute)
    return ctypes.cast(library.sgemm_linear, ctypes.c_void_p).value or 0


def _pack(library: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    weight = weight.detach().contiguous()
    size = library.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS, n, k)
    data = torch.empty(size, dtype=torch.uint8)
    library.cblas_sgemm_pack(
        _ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS, n, k, 1.0, weight.data_ptr(), k, data.data_ptr()
    )
    return data


def _multiply(library: ctypes.CDLL, x: torch.Tensor, data: torch.Tensor, n: int) -> torch.Tensor:
    rows, k = x.shape
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows:
        library.cblas_sgemm_compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, rows, n, k, x.data_ptr(), k, data.data_ptr(), k, 0.0,
            out.data_ptr(), n,
        )  # fmt: skip
    return out


def sgemm_linear(x: torch.Tensor, weight: SgemmWeight) -> torch.Tensor:
    """``x @ W^T`` for float32 rows ``x`` ``[..., in_features]``."""
    library = _library()
    assert library is not None, "SgemmWeight exists only where the library does"
    if x.dtype != torch.float32 or x.shape[-1] != weight.in_features:
        raise ValueError(
            f"expected float32 rows of {weight.in_features}, got {x.dtype} {tuple(x.shape)}"
        )
    rows = x.reshape(-1, weight.in_features).contiguous()
    out = _multiply(library, rows, weight.data, weight.out_features)
    return out.reshape(*x.shape[:-1], weight.out_features)


def compute_address() -> int:
    """``cblas_sgemm_compute``'s address (for ``cpu_ops.sgemm_linear``), or 0 without it."""
    library = _library()
    if library is None:
        return 0
    return ctypes.cast(library.cblas_sgemm_compute, ctypes.c_void_p).value or 0
