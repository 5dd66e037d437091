"""The linear layer: ``y = x W^T (+ b)`` with ``W`` held in one :class:`WeightForm`.

A layer is built dense (a plain parameter: loadable, trainable, the form on CUDA). For CPU
inference :meth:`Linear.pack` re-lays it out in the first packed form of ``PACKED_FORMS`` that
fits (MKL's packed GEMM for float32 where torch exports it, AMX tiles for bfloat16 where the
CPU has them, oneDNN's layout otherwise), and :meth:`Linear.use_form` gives it any other form
(a GGUF file's blocks); either drops the plain weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specbatch.kernels.amx_linear import TileWeight
from specbatch.kernels.onednn import OneDnnWeight
from specbatch.kernels.sgemm import SgemmWeight
from specbatch.kernels.weight_forms import DenseForm, WeightForm

PackedForm = SgemmWeight | TileWeight | OneDnnWeight
# The packed forms, in order of preference; the first that fits a weight holds it.
PACKED_FORMS: tuple[type[PackedForm], ...] = (
    SgemmWeight,  # float32: faster than oneDNN to 64 rows (kernels/sgemm.py), C-callable
    TileWeight,  # bfloat16: 1.1-3x oneDNN to 64 rows (kernels/amx_linear.py), C-callable
    OneDnnWeight,
)


def packing_supported(dtype: torch.dtype) -> bool:
    """True when :meth:`Linear.pack` has a packed form for ``dtype`` weights here."""
    probe = torch.zeros(8, 32, dtype=dtype)
    return any(form.fits(probe) for form in PACKED_FORMS)


def packed_form(
    weight: torch.Tensor, forms: Sequence[type[PackedForm]] = PACKED_FORMS
) -> WeightForm:
    """``weight`` in the first of ``forms`` that fits it (call only where one does)."""
    for form in forms:
        if form.fits(weight):
            return form.from_dense(weight)
    raise ValueError(f"no packed form holds a {weight.dtype} weight here")


class Linear(nn.Module):
    """``y = x W^T (+ b)``, ``W`` in :attr:`form`; :attr:`weight` is the plain parameter while
    the form is dense, None after."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        form: WeightForm | None = None,
    ) -> None:
        """A dense layer, or one in ``form`` (shared, e.g. a tied LM head's: then no parameter
        of its own is allocated)."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: nn.Parameter | None = None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.form: WeightForm = DenseForm(self)
        if form is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
        else:
            self.use_form(form)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.form.multiply(x, self.bias)

    @property
    def dense(self) -> bool:
        """Whether the weight is still the plain parameter."""
        return isinstance(self.form, DenseForm)

    def use_form(self, form: WeightForm) -> None:
        """Multiply with ``form`` from now on; the plain weight is dropped (the form may be
        shared: a tied LM head's is the embedding's)."""
        if (form.out_features, form.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"the weight is {form.out_features}x{form.in_features}, the layer "
                f"{self.out_features}x{self.in_features}"
            )
        self.form = form
        self.weight = None

    def pack(self) -> None:
        """Re-lay a dense weight out in its packed form (call only where
        :func:`packing_supported`); other forms stay as they are."""
        if self.weight is not None and self.dense:
            self.use_form(packed_form(self.weight.detach()))
