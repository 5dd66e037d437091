"""Linear layers, with weights pre-packed for oneDNN on x86 CPUs.

On this class of CPU, torch's default float32 ``F.linear`` (MKL) is slow for the small row counts
of decoding and verification: a 4-row product costs ~1.8x a 1-row one. oneDNN with weights
reordered once into its blocked layout runs the same products 1.3-2x faster and grows far more
slowly with the row count (measured on SmolLM2's shapes: 8 rows cost ~1.4x one row), which is
exactly the asymmetry speculative decoding feeds on. Packing is an inference-only step: packed
layers drop their plain weight and have no autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbatch.kernels.gguf_linear import QuantizedWeight, quantized_linear

_PACK_BATCH_HINT = 8  # oneDNN picks its weight layout for this row count; any count works


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


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with a plain weight (loadable, trainable), a packed one, or GGUF
    blocks multiplied as they are (``kernels.gguf_linear``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = quantized_linear(x, self.quantized)
            return out if self.bias is None else out + self.bias
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias, self.out_features)
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
        """Replace the plain weight by its oneDNN layout (call only if supported)."""
        if self.weight is None:  # packed already, or quantized
            return
        self.packed = pack_weight(self.weight.detach())
        self.weight = None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_BATCH_HINT)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    if x.shape[0] == 0:
        return x.new_empty(0, out_features)
    if x.shape[0] == 1:
        # oneDNN multiplies a single row (its matrix-vector path) in another order than two or
        # more rows (measured on SmolLM2's down projection, K = 1536, in float32 and bfloat16),
        # so a row's bits would depend on how many rows share the step: in bfloat16 that
        # changed greedy text with the batch. Two rows cost the same as one.
        out = torch.ops.mkldnn._linear_pointwise(
            x.expand(2, -1).contiguous(), packed, bias, "none", [], ""
        )
        return out[:1]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
