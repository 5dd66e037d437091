"""Linear layers over GGUF Q4_1 / Q8_0 weights kept quantized in memory, multiplied in C.

Batch-1 decoding reads every weight once per token, so its speed is the bytes per weight:
4 in float32, about 0.75 for Q4_1 and 1.1 for Q8_0 as held here. ``QuantizedWeight`` repacks a
tensor's blocks once at load (layout in ``gguf_linear.c``); ``quantized_linear`` multiplies with
them directly. Results are the exact product with the file's dequantised values up to float32
summation, and each output row's bits are independent of the batch, the tiling and the thread
count, so a speculative verify step (k + 1 rows) and a decode step (1 row) agree.

The C file is compiled at first use (``cbuild``); where no compiler works the layer says so once
and multiplies with weights dequantised at every call instead (slow, for correctness only).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specbatch.kernels.cbuild import NATIVE_FLAGS, NativeLibrary
from specbatch.kernels.weight_forms import FusedPart, add_bias, call_linear, check_float32_rows

SOURCE = Path(__file__).with_name("gguf_linear.c")
FLAGS = (*NATIVE_FLAGS, "-ffp-contract=off")
BLOCK = 32  # weights per block along a row
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # in the file: fp16 d (and fp16 m), then the codes
GROUP = 4  # blocks per record
PANEL = 8  # rows per panel
_CODE_BYTES = {"q4_1": GROUP * BLOCK // 2, "q8_0": GROUP * BLOCK}  # per record
_SCALES = {"q4_1": 2, "q8_0": 1}  # float32 scales per block: (d, m) or d
_KERNEL_KIND = {"q4_1": 0, "q8_0": 1}


def _fp16(cells: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 at byte ``offset`` of each block, as float32 (exact)."""
    return (
        np.ascontiguousarray(cells[..., offset : offset + 2])
        .view(np.float16)[..., 0]
        .astype(np.float32)
    )


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [out_features, in_features] weight held as GGUF blocks, repacked for the kernel.

    ``data`` is uint8 [ceil(N / 8), groups * 8 * record]: panels of 8 rows (zero-padded), each
    the sequence over groups of 4 blocks of one record per row: the codes (Q4_1: 64 bytes, byte
    b of 32-bit lane j being block b's qs[j]; Q8_0: the 128 int8 values) then the blocks'
    float32 scales ((d, m) or d). See ``gguf_linear.c`` for why.
    """

    kind: str
    in_features: int
    out_features: int
    data: torch.Tensor

    @classmethod
    def from_blocks(cls, raw: np.ndarray, kind: str, in_features: int) -> QuantizedWeight:
        """From a tensor's bytes as in the file: uint8 [N, K / 32 * block bytes], one row per
        output (K = ``in_features``, a multiple of 32); ``kind`` is "q4_1" or "q8_0"."""
        if kind not in BLOCK_BYTES:
            raise ValueError(f"kind must be one of {sorted(BLOCK_BYTES)}, got {kind!r}")
        if in_features <= 0 or in_features % BLOCK:
            raise ValueError(f"in_features must be a positive multiple of 32, got {in_features}")
        blocks = in_features // BLOCK
        width = blocks * BLOCK_BYTES[kind]
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != width:
            raise ValueError(
                f"raw must be a uint8 array [out_features, {width}] for {kind} with "
                f"in_features={in_features}, got {raw.dtype} {list(raw.shape)}"
            )
        n, groups = raw.shape[0], -(-blocks // GROUP)
        record = _CODE_BYTES[kind] + GROUP * _SCALES[kind] * 4
        panels = np.empty((-(-n // PANEL), groups * PANEL * record), np.uint8)
        # in runs of rows (whole panels): the repacking's temporaries stay small (a 262k-row
        # embedding repacked at once had doubled the load's peak memory)
        for start in range(0, n, _REPACK_ROWS):
            rows = raw[start : start + _REPACK_ROWS]
            panels[start // PANEL : start // PANEL + -(-len(rows) // PANEL)] = _panels(
                rows, kind, blocks, groups
            )
        data = torch.from_numpy(panels)
        return cls(kind, in_features, n, data)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether ``weight`` can be quantized to Q8_0 (:meth:`from_dense`): a 2-D matrix
        whose rows are whole blocks of 32."""
        return weight.dim() == 2 and weight.shape[1] > 0 and weight.shape[1] % BLOCK == 0

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> QuantizedWeight:
        """``weight`` [N, K] (K a multiple of 32) quantized to Q8_0 as ggml does
        (:func:`quantize_q8_0`)."""
        array = weight.detach().to(torch.float32).cpu().numpy()
        return cls.from_blocks(quantize_q8_0(array), "q8_0", weight.shape[1])

    @property
    def nbytes(self) -> int:
        """Resident bytes."""
        return self.data.numel()

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return add_bias(quantized_linear(x, self), bias)

    def fused_part(self) -> FusedPart | None:
        """``gguf_linear``, the function :func:`quantized_linear` calls."""
        library = load_library()
        if library is None:
            return None
        linear = ctypes.cast(library.gguf_linear, ctypes.c_void_p).value or 0
        return FusedPart(linear, _KERNEL_KIND[self.kind], self.data.data_ptr(), torch.float32)

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight, equal bit for bit to gguf's dequantisation."""
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantised rows ``ids`` (an embedding lookup): float32 [*ids.shape, K], by the C
        library where it is built (a decode's row: 13 us against 81 as torch calls)."""
        library = load_library()
        if library is None or ids.device.type != "cpu":
            return self.rows_reference(ids)
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(len(flat), self.in_features, dtype=torch.float32)
        status = library.gguf_rows(
            _KERNEL_KIND[self.kind],
            self.data.data_ptr(),
            self.out_features,
            self.in_features,
            flat.data_ptr(),
            len(flat),
            out.data_ptr(),
        )
        if status != 0:
            raise IndexError(f"row ids must lie in [0, {self.out_features}), got {ids.tolist()}")
        return out.reshape(*ids.shape, self.in_features)

    def rows_reference(self, ids: torch.Tensor) -> torch.Tensor:
        """``rows`` as torch operations (the C library's reference, and where it is not built)."""
        if not ids.numel():  # (no records to reshape)
            return torch.empty(*ids.shape, self.in_features, dtype=torch.float32)
        if not 0 <= int(ids.min()) <= int(ids.max()) < self.out_features:
            raise IndexError(f"row ids must lie in [0, {self.out_features}), got {ids.tolist()}")
        flat = ids.reshape(-1)
        panels = self.data.view(self.data.shape[0], -1, PANEL, self._record_bytes)
        records = panels[flat // PANEL, :, flat % PANEL]  # [len(flat), groups, record]
        return self._dequantize(records).reshape(*ids.shape, self.in_features)

    def _dequantize(self, records: torch.Tensor) -> torch.Tensor:
        count, blocks, code_bytes = (
            records.shape[0],
            self.in_features // BLOCK,
            _CODE_BYTES[self.kind],
        )
        scales = records[..., code_bytes:].contiguous().view(torch.float32)
        scales = scales.reshape(count, -1, _SCALES[self.kind])[:, :blocks]
        codes = records[..., :code_bytes]
        if self.kind == "q8_0":
            q = codes.contiguous().view(torch.int8).reshape(count, -1, BLOCK)[:, :blocks]
            return (q.float() * scales).reshape(count, self.in_features)
        lanes = codes.reshape(count, -1, BLOCK // 2, GROUP).transpose(2, 3)
        cells = lanes.reshape(count, -1, BLOCK // 2)[:, :blocks]
        q = torch.cat([cells & 0xF, cells >> 4], dim=-1).float()
        # d q is exact in float32, so this rounds once, as gguf's (d * q) + m does
        return (q * scales[..., :1] + scales[..., 1:]).reshape(count, self.in_features)

    @property
    def _record_bytes(self) -> int:
        return _CODE_BYTES[self.kind] + GROUP * _SCALES[self.kind] * 4


_REPACK_ROWS = 4096  # a multiple of PANEL


def _panels(raw: np.ndarray, kind: str, blocks: int, groups: int) -> np.ndarray:
    """Rows of a tensor's bytes (uint8 [rows, blocks * block bytes]) as their panels (the
    layout of ``QuantizedWeight.data``; the last panel padded with zero rows)."""
    n = raw.shape[0]
    cells = np.zeros((-(-n // PANEL) * PANEL, groups * GROUP, BLOCK_BYTES[kind]), np.uint8)
    cells[:n, :blocks] = raw.reshape(n, blocks, -1)
    cells = cells.reshape(cells.shape[0], groups, GROUP, -1)
    if kind == "q4_1":  # lane j of a record: the four blocks' qs[j]
        codes = cells[..., 4:].transpose(0, 1, 3, 2)
        scales = np.stack([_fp16(cells, 0), _fp16(cells, 2)], axis=-1)
    else:
        codes, scales = cells[..., 2:], _fp16(cells, 0)
    records = np.concatenate(
        [
            np.ascontiguousarray(codes).reshape(*cells.shape[:2], -1),
            np.ascontiguousarray(scales).view(np.uint8).reshape(*cells.shape[:2], -1),
        ],
        axis=-1,
    )
    panels = records.reshape(-1, PANEL, groups, records.shape[-1]).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(panels).reshape(panels.shape[0], -1)


def quantize_q8_0(weight: np.ndarray) -> np.ndarray:
    """ggml's reference Q8_0 quantisation of float32 rows [N, K] (K a multiple of 32): per
    block of 32, d = max |w| / 127 (stored as fp16) and q = round(w / d) (half away from zero,
    with the float32 reciprocal of the unrounded d), as the bytes of a GGUF tensor: uint8
    [N, K / 32 * 34]. Bit-equal to ``gguf.quants.quantize`` (tested)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"in_features must be a multiple of 32, got {k}")
    blocks = np.ascontiguousarray(weight, dtype=np.float32).reshape(n, k // BLOCK, BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
    scaled = blocks * inverse
    magnitude = np.abs(scaled)
    whole = np.floor(magnitude)  # a half rounds away from zero; no float32 sum rounds first
    q = (np.sign(scaled) * (whole + np.floor(2 * (magnitude - whole)))).astype(np.int8)
    cells = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1)
    return cells.reshape(n, -1)


def declare(library: ctypes.CDLL) -> None:
    """The C functions' signatures."""
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.gguf_linear.restype = ctypes.c_int
    library.gguf_linear_isa.restype = ctypes.c_int
    library.gguf_linear_isa.argtypes = []
    library.gguf_rows.restype = ctypes.c_int
    library.gguf_rows.argtypes = [
        ctypes.c_int, pointer, i64, i64,  # kind, weights, N, K
        pointer, i64, pointer,  # ids, count, out
    ]  # fmt: skip
    library.gguf_linear.argtypes = [
        ctypes.c_int, pointer, i64, i64,  # kind, x, rows, K
        pointer, i64,  # weights, N
        pointer, ctypes.c_int,  # out, threads
    ]  # fmt: skip


NATIVE = NativeLibrary(
    SOURCE,
    FLAGS,
    "the GGUF quantized linear kernel",
    "quantized weights are dequantised at every multiply (slow)",
    declare,
)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use), or None where it cannot be built."""
    return NATIVE.load()


def kernel_available() -> bool:
    """True when the C kernel is built (building it now if needed): no fallback."""
    return load_library() is not None


VECTOR_ISAS = ("plain", "avx2", "avx512")  # by gguf_linear_isa()'s code


def vector_isa() -> str | None:
    """The instruction set the built kernel multiplies with: "avx512", "avx2" (with FMA) or
    "plain" (C without vectors: slower than float32 oneDNN), or None where it cannot be built."""
    library = load_library()
    return None if library is None else VECTOR_ISAS[library.gguf_linear_isa()]


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x @ weight.dequantize().T`` for float32 ``x`` [M, K] (M may be 0): float32 [M, N]."""
    check_float32_rows(x, weight.in_features)
    library = load_library()
    if library is not None:
        return run_kernel(library, x.contiguous(), weight)
    # One matrix-vector product per row: a row's bits still do not depend on the batch.
    dense = weight.dequantize()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    for row in range(x.shape[0]):
        torch.mv(dense, x[row], out=out[row])
    return out


def run_kernel(library: ctypes.CDLL, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The C kernel of ``library`` on contiguous float32 ``x`` [M, K]."""
    if x.shape[0] == 0:
        return torch.empty(0, weight.out_features, dtype=torch.float32)
    kind = _KERNEL_KIND[weight.kind]
    out, status = call_linear(library.gguf_linear, kind, x, weight.data, weight.out_features)
    if status != 0:
        raise MemoryError("the GGUF linear kernel could not allocate its scratch memory")
    return out
