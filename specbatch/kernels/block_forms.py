"""Which weight form holds a GGUF tensor of each type as stored: the registry of block forms.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, IQ4_NL and IQ4_XS are rearranged for AMX tiles where
the CPU has them (``kernels.gguf_tiles``: level with the panels at one row, 1.3x at 5, 1.5-1.9x
at 16-64 on SmolLM2's products); elsewhere Q4_1 and Q8_0 are repacked into panels for their own
kernel (``kernels.gguf_linear``: faster than the stored layout, SmolLM2's products 4.2 against
5.3 ms at one row and 60.6 against 78.2 at 64, ``gguf_blocks`` timed beside it on the Intel
AVX-512 host, 2026-12-06); every other supported type is multiplied as the file stores it
(``kernels.gguf_blocks``). The panels and the stored layout give the same bits (one summation
order: ``tests/kernels/test_gguf_block_linear.py``); the tiles sum each block apart before its
scale, so theirs differ, the same at every row count. A new block type is a C dequantiser in
``gguf_blocks.c`` and its ``BLOCK_TYPES`` entry (for tiles, also its case in ``gguf_amx.c``'s
``file_block`` and a ``gguf_tiles._KIND`` line), and nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specbatch.kernels import gguf_tiles
from specbatch.kernels.gguf_blocks import BLOCK_TYPES, BlockWeight
from specbatch.kernels.gguf_linear import QuantizedWeight
from specbatch.kernels.gguf_tiles import TILED_TYPES, TileBlockWeight
from specbatch.kernels.weight_forms import StackedWeight, WeightForm

BlockForm = QuantizedWeight | TileBlockWeight | BlockWeight
RepackedForm = QuantizedWeight | TileBlockWeight  # Q4_1 / Q8_0, whichever holds them here
_REPACKED = {"Q4_1": "q4_1", "Q8_0": "q8_0"}


def _stored(name: str) -> Callable[[np.ndarray, int], BlockForm]:
    def make(raw: np.ndarray, in_features: int) -> BlockForm:
        if name in TILED_TYPES and gguf_tiles.available():
            return TileBlockWeight.from_blocks(raw, name.lower(), in_features)
        return BlockWeight.from_blocks(raw, name, in_features)

    return make


def _repacked(kind: str) -> Callable[[np.ndarray, int], BlockForm]:
    def make(raw: np.ndarray, in_features: int) -> BlockForm:
        if gguf_tiles.available():
            return TileBlockWeight.from_blocks(raw, kind, in_features)
        return QuantizedWeight.from_blocks(raw, kind, in_features)

    return make


def q8_0_form(weight: torch.Tensor) -> BlockForm:
    """A float32 weight quantized to Q8_0 (ggml's rounding) in the form a file's Q8_0 matrix
    gets here (a draft model under a target of GGUF blocks)."""
    if gguf_tiles.available():
        return TileBlockWeight.from_dense(weight)
    return QuantizedWeight.from_dense(weight)


# ggml type name -> the form made from a tensor's bytes (uint8 [N, row bytes]) and its K
BLOCK_FORMS: dict[str, Callable[[np.ndarray, int], BlockForm]] = {
    name: _repacked(_REPACKED[name]) if name in _REPACKED else _stored(name) for name in BLOCK_TYPES
}


def block_form(type_name: str, raw: np.ndarray, in_features: int) -> BlockForm:
    """The form holding a tensor of ggml type ``type_name`` as stored; ``ValueError`` for a
    type without one, or bytes that are not whole rows of blocks."""
    make = BLOCK_FORMS.get(type_name)
    if make is None:
        raise ValueError(
            f"GGUF tensor type {type_name} is not multiplied as stored; supported: "
            f"{', '.join(BLOCK_FORMS)}"
        )
    return make(raw, in_features)


def stacked_blocks(parts: Sequence[tuple[str, np.ndarray]], in_features: int) -> WeightForm:
    """One form for a fused projection's shards ``(type name, bytes)``, in order: each run of
    shards of one type joined into one tensor, a stack of the runs' forms where there are
    several (q and k in Q5_0 then v in Q8_0: two parts)."""
    runs: list[tuple[str, list[np.ndarray]]] = []
    for name, raw in parts:
        if runs and runs[-1][0] == name:
            runs[-1][1].append(raw)
        else:
            runs.append((name, [raw]))
    forms = [block_form(name, np.concatenate(raws), in_features) for name, raws in runs]
    return forms[0] if len(forms) == 1 else StackedWeight(forms)


def holds_blocks(form: WeightForm) -> bool:
    """Whether ``form`` is a file's blocks as stored (or a stack of them)."""
    if isinstance(form, StackedWeight):
        return all(holds_blocks(part) for part in form.parts)
    return isinstance(form, RepackedForm | BlockWeight)
