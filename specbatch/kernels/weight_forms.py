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

A new block type is one C kernel, one form and one line in its registry
(``kernels.gguf_forms.BLOCK_FORMS``); packed forms are tried in the order of
``kernels.linear.PACKED_FORMS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


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
