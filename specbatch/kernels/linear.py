"""Linear layers, with weights pre-packed on x86 CPUs: float32 for MKL's packed GEMM
(``kernels.sgemm``) where torch carries it, bfloat16 as AMX tiles (``kernels.amx_linear``)
where the CPU has them, otherwise for oneDNN.

On this class of CPU, torch's default float32 ``F.linear`` (MKL) is slow for the small row counts
of decoding and verification: a 4-row product costs ~1.8x a 1-row one. oneDNN with weights
reordered once into its blocked layout runs the same products 1.3-2x faster and grows far more
slowly with the row count (measured on SmolLM2's shapes: 8 rows cost ~1.4x one row), which is
exactly the asymmetry speculative decoding feeds on. Packing is an inference-only step: packed
layers drop their plain weight and have no autograd.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specbatch.kernels import amx_linear, sgemm
from specbatch.kernels.amx_linear import TileWeight
from specbatch.kernels.gguf_linear import QuantizedWeight, quantized_linear
from specbatch.kernels.sgemm import SgemmWeight, sgemm_linear

_PACK_BATCH_HINT = 8  # oneDNN picks its weight layout for this row count; any count works
PADDED_ROWS = 8  # products of up to this many rows may be computed with more (row padding)
_PADDING_GAIN = 0.9  # ... when that is measured to take at most this share of the time


def cpu_packing_supported(dtype: torch.dtype) -> bool:
    """True when oneDNN can pack ``dtype`` (float32, bfloat16) weights on this machine."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        weight = torch.zeros(8, 8, dtype=dtype)
        probe = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        x = torch.ones(2, 8, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, probe, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(out.shape == (2, 8))


def packing_supported(dtype: torch.dtype) -> bool:
    """True when :meth:`Linear.pack` has a layout for ``dtype`` weights here: MKL's for
    float32 where torch exports it, AMX tiles for bfloat16 where the CPU has them, oneDNN's
    otherwise."""
    return (
        (dtype == torch.float32 and sgemm.available())
        or (dtype == torch.bfloat16 and amx_linear.available())
        or cpu_packing_supported(dtype)
    )


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with a plain weight (loadable, trainable), a packed one (MKL's
    layout, ``sgemm``; AMX tiles, ``tiles``; or oneDNN's, ``packed``), or GGUF blocks
    multiplied as they are (``kernels.gguf_linear``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.sgemm: SgemmWeight | None = None
        self.tiles: TileWeight | None = None
        self.quantized: QuantizedWeight | None = None
        # rows to compute a packed product of m <= PADDED_ROWS rows with (measure_row_padding)
        self.row_padding: Sequence[int] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = quantized_linear(x, self.quantized)
            return out if self.bias is None else out + self.bias
        if self.sgemm is not None:
            out = sgemm_linear(x, self.sgemm)
            return out if self.bias is None else out + self.bias
        if self.tiles is not None:
            out = amx_linear.amx_linear(x, self.tiles)
            return out if self.bias is None else out + self.bias
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias, self.out_features, self.row_padding)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def use_quantized(self, weight: QuantizedWeight) -> None:
        """Multiply with ``weight``'s blocks from now on; the plain weight is dropped."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight is {weight.out_features}x{weight.in_features}, the layer "
                f"{self.out_features}x{self.in_features}"
            )
        self.quantized = weight
        self.weight = None

    def pack(self) -> None:
        """Replace the plain weight by MKL's packed layout (float32, where available), AMX
        tiles (bfloat16, where available) or oneDNN's (call only where
        :func:`packing_supported`)."""
        if self.weight is None:  # packed already, or quantized
            return
        if sgemm.fits(self.weight):
            self.sgemm = SgemmWeight.from_dense(self.weight.detach())
        elif amx_linear.fits(self.weight):
            self.tiles = TileWeight.from_dense(self.weight.detach())
        else:
            self.packed = pack_weight(self.weight.detach())
        self.weight = None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_BATCH_HINT)


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    padding: Sequence[int] = (),
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with W packed by :func:`pack_weight`; a product of m rows is
    computed with ``padding[m]`` rows where the table has m (copies of the first row fill the
    rest), one row always with at least two.

    One row as two: oneDNN multiplies a single row (its matrix-vector path) in another order
    than two or more (measured on SmolLM2's down projection, K = 1536, in float32 and
    bfloat16), so a row's bits would depend on how many rows share the step: in bfloat16 that
    changed greedy text with the batch. The padding table: see :func:`measure_row_padding`.
    """
    rows = x.shape[0]
    if rows == 0:
        return x.new_empty(0, out_features)
    computed = padding[rows] if rows < len(padding) else max(rows, 2)
    if computed > rows:
        x = torch.cat([x, x[:1].expand(computed - rows, -1)])
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows] if computed > rows else out


def measure_row_padding(
    products: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    widths: Sequence[int],
    dtype: torch.dtype,
) -> tuple[int, ...]:
    """A padding table for :func:`packed_linear`: for m = 1 .. PADDED_ROWS rows, the count
    at or above m (at least 2) that a sweep over every product of a model takes least time
    with, if that is at most 90% of m's own time; otherwise m (2 for one row).

    On some CPUs a product of 1-3 rows costs more than one of 4-5 while the weights stream
    from memory (seen on an AMD EPYC host: SmolLM2's linears 25.8 ms for one row, 17.9 for
    five, ``benchmarks/linear_rows.py``; the same matrices timed alone, in cache, grow
    monotonically), so the sweep runs the model's own products (``widths``: each one's input
    features, ``dtype`` their inputs'). A count is only a candidate if every product gives
    the first row the same bits with it as with two rows: padding must not change what a row
    computes.
    """
    if not products:
        return ()
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(PADDED_ROWS, w, generator=generator).to(dtype) for w in widths]
    counts = range(2, PADDED_ROWS + 1)
    reference = [product(x[:2])[0] for product, x in zip(products, inputs, strict=True)]
    same_bits = {
        m: all(
            torch.equal(product(x[:m])[0], ref)
            for product, x, ref in zip(products, inputs, reference, strict=True)
        )
        for m in counts
    }

    def sweep(m: int) -> float:
        start = time.perf_counter()
        for product, x in zip(products, inputs, strict=True):
            product(x[:m])
        return time.perf_counter() - start

    cost = {m: statistics.median(sweep(m) for _ in range(3)) for m in counts}
    return padding_table(cost, same_bits)


def padding_table(cost: dict[int, float], same_bits: dict[int, bool]) -> tuple[int, ...]:
    """``padding[m]`` for m = 1 .. PADDED_ROWS from the measured ``cost`` of 2 ..
    PADDED_ROWS rows: the cheapest count at or above max(m, 2) whose bits agree, if it costs
    at most 90% of m's own count (one row costs what two do), else that own count."""
    padding = [0]
    for m in range(1, PADDED_ROWS + 1):
        own = max(m, 2)
        usable = [n for n in range(own, PADDED_ROWS + 1) if same_bits[n]]
        best = min(usable, key=lambda n: cost[n], default=own)
        padding.append(best if cost[best] <= _PADDING_GAIN * cost[own] else own)
    return tuple(padding)
