"""oneDNN's packed linear for float32 and bfloat16 CPU weights: the packed form where neither
MKL's packed GEMM (``kernels.sgemm``, float32) nor AMX tiles (``kernels.amx_linear``,
bfloat16) are available.

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

from specbatch.kernels.weight_forms import FusedPart

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


class OneDnnWeight:
    """A float32 or bfloat16 weight in oneDNN's blocked layout (:func:`pack_weight`),
    multiplied by :func:`packed_linear` with its row ``padding`` (set by
    :func:`measure_row_padding` over a model's own products; none until then)."""

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int) -> None:
        self.packed = packed
        self.out_features = out_features
        self.in_features = in_features
        self.padding: Sequence[int] = ()

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether oneDNN can pack ``weight`` here."""
        return weight.dim() == 2 and cpu_packing_supported(weight.dtype)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> OneDnnWeight:
        return cls(pack_weight(weight.detach()), weight.shape[0], weight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return packed_linear(x, self.packed, bias, self.out_features, self.padding)

    def fused_part(self) -> FusedPart | None:
        return None  # torch exports no C entry to oneDNN's products
