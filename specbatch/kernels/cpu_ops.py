"""Small per-layer CPU operations in C (``cpu_ops.c``): RMSNorm over float32 rows.

At decode sizes torch spends more on dispatching an RMSNorm's handful of ops than on the work
(a 576-wide row: ~10 us, twice per layer); one ctypes call does it in ~1 us. Where no compiler
works, callers keep torch's implementation (``rms_norm`` returns None).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from specbatch.kernels.cbuild import NATIVE_FLAGS, load_c_library

SOURCE = Path(__file__).with_name("cpu_ops.c")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_failed = False


def load_library() -> ctypes.CDLL | None:
    """The compiled operations (built on first use), or None where they cannot be built."""
    global _library, _load_failed
    with _lock:
        if _library is None and not _load_failed:
            library = load_c_library(
                SOURCE, NATIVE_FLAGS, "the CPU layer operations", "torch's are used instead"
            )
            if library is None:
                _load_failed = True
            else:
                pointer, i64 = ctypes.c_void_p, ctypes.c_int64
                library.rms_norm.restype = None
                library.rms_norm.argtypes = [
                    pointer, i64, i64, i64, pointer, ctypes.c_float, pointer, ctypes.c_int
                ]  # fmt: skip
                _library = library
        return _library


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension of float32 CPU rows
    ``[T, D]`` (rows may be strided, elements contiguous); None where this path does not
    apply (another dtype, device or layout, or no compiled library)."""
    library = _library or (None if _load_failed else load_library())
    if (
        library is None
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.stride(1) != 1
        or not weight.is_contiguous()
        or weight.shape[0] != x.shape[1]
    ):
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    library.rms_norm(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        x.stride(0),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
