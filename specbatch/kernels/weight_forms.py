"""The one owner of how a weight is held and multiplied: its *form*.

A linear layer's weight ``W`` ``[out_features, in_features]`` can be held plain (a tensor
``F.linear`` multiplies), re-laid out once for a CPU library (MKL's packed GEMM, AMX tiles,
oneDNN's blocked layout) or kept as a GGUF file's blocks, each block type multiplied by its own
C kernel. Each of those is a :class:`WeightForm`: it says whether it can hold a weight here
(``fits``), is made from a dense weight or from a file's blocks, multiplies rows with itself,
reports its resident bytes, and tells the fused CPU layer call (``kernels.fused_layers``) which
C function multiplies it and where its bytes are (:class:`FusedPart`), or that it has none.
Nothing outside a form asks which form it is: ``Linear``, the tied LM head, the embedding and
the fused layers all go through this interface (ggml's per-type ``type_traits`` are the model).

The block forms are chosen by a tensor's GGUF type (``kernels.block_forms.BLOCK_FORMS``); a
new block type is a C dequantiser and one registry line. Packed forms are tried in the order
of ``kernels.linear.PACKED_FORMS``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from specbatch.kernels import cpu_ops


@dataclass(frozen=True)
class FusedPart:
    """What the fused layer call needs of one form: the C function that multiplies it (by
    address, with ``cpu_ops.c``'s ``linear_fn`` signature, or ``bf16_linear_fn`` where
    ``activation`` is bfloat16), the ``kind`` code that function takes, and the address of the
    form's bytes. The form must outlive the call (the model holds it)."""

    linear: int
    kind: int
    data: int
    activation: torch.dtype


@runtime_checkable
class WeightForm(Protocol):
    """A weight ``[out_features, in_features]`` in one of the forms above."""

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """Resident bytes of the form itself."""
        ...

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` for rows ``x`` ``[M, in_features]``."""
        ...

    def fused_part(self) -> FusedPart | None:
        """Its part in a fused CPU layer call, or None where it has no C kernel."""
        ...


class DenseForm:
    """A plain weight, multiplied by ``F.linear``: the form a model is built and trained in,
    and the only one on CUDA. It reads ``owner.weight`` at every call, so it follows the
    parameter through ``.to()``, ``to_empty`` and loading (the owner: a ``Linear`` or, for a
    tied LM head, the token embedding)."""

    def __init__(self, owner: torch.nn.Module) -> None:
        self.owner = owner

    @property
    def weight(self) -> torch.Tensor:
        weight = self.owner.weight
        assert isinstance(weight, torch.Tensor), "a dense form's owner holds its weight"
        return weight

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        """0: the weight is the owner's parameter, counted with the parameters."""
        return 0

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def fused_part(self) -> FusedPart | None:
        return None


def add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out + bias`` (a new tensor), or ``out`` without one: how forms whose kernels take no
    bias apply it."""
    return out if bias is None else out + bias


def check_float32_rows(x: torch.Tensor, in_features: int) -> None:
    """``ValueError`` unless ``x`` is float32 CPU rows [M, ``in_features``]: what the block
    forms' C kernels multiply."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be float32 [M, {in_features}], got {x.dtype} {list(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"x must be on the CPU, got {x.device}")


def call_linear(
    fn: Callable[..., int], kind: int, x: torch.Tensor, data: torch.Tensor, out_features: int
) -> tuple[torch.Tensor, int]:
    """A C kernel of ``cpu_ops.c``'s ``linear_fn`` signature on contiguous float32 ``x`` [M, K]
    over the weight bytes ``data``, with torch's thread count: float32 [M, ``out_features``]
    and the kernel's status."""
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    status = fn(
        kind,
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        data.data_ptr(),
        out_features,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out, int(status)


class StackedWeight:
    """A weight stacked along its outputs from parts of different forms: a fused q/k/v (or
    gate/up) projection whose shards a file stores in different types (a Q4_K_M file's q and
    k in Q5_0 and v in Q8_0). Each part multiplies with its own kernel; the outputs are
    concatenated (in a fused layer by ``cpu_ops.stacked_linear``, the same products copied
    into their columns)."""

    def __init__(self, parts: Sequence[WeightForm]) -> None:
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("a stacked weight needs parts of one input width")
        self.parts = tuple(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self._specs: ctypes.Array[cpu_ops.StackedPartSpec] | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([p.multiply(x) for p in self.parts], dim=-1)
        return add_bias(out, bias)

    def fused_part(self) -> FusedPart | None:
        """``stacked_linear`` over the parts' own kernels, where every part has one for
        float32 rows."""
        parts = [p.fused_part() for p in self.parts]
        linear = _stacked_linear()
        if not linear or any(p is None or p.activation != torch.float32 for p in parts):
            return None
        if self._specs is None:  # kept: the fused layer reads it at every call
            specs = [
                cpu_ops.StackedPartSpec(p.linear, p.kind, p.data, form.out_features)
                for p, form in zip(parts, self.parts, strict=True)
                if p is not None
            ]
            self._specs = (cpu_ops.StackedPartSpec * len(specs))(*specs)
        return FusedPart(linear, len(self.parts), ctypes.addressof(self._specs), torch.float32)


@functools.cache
def _stacked_linear() -> int:
    """``cpu_ops.stacked_linear``'s address, or 0 where the library cannot be built."""
    library = cpu_ops.load_library()
    if library is None:
        return 0
    return ctypes.cast(library.stacked_linear, ctypes.c_void_p).value or 0
