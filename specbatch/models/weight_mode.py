"""Which form the target's weights take: the fastest exact one unless the settings say otherwise.

``quantization="auto"`` (the default) multiplies a GGUF file's matrices as they are stored
(``"gguf"``: every weight the file's exact value, float32 activations and sums) when that is
the fastest exact mode this machine has: on the CPU, for a ``.gguf`` model whose layer matrices
are all of types a block form holds (``kernels.block_forms.BLOCK_FORMS``), with no explicit
``dtype``, in one process, where the kernels were built with a vector path. Otherwise the
weights are dequantised to ``dtype`` (float32 on the CPU), with one log line saying why when
only the file or the machine stood in the way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specbatch.errors import ConfigError
from specbatch.models.loader import QUANTIZATIONS, parse_dtype

logger = logging.getLogger("specbatch")

QUANTIZATION_SETTINGS = ("auto", *QUANTIZATIONS)  # and None: dequantised to the dtype


@dataclass(frozen=True)
class WeightMode:
    """How the target is loaded: ``dtype`` of its activations (and of dequantised weights) and
    ``quantization`` ("gguf": the file's blocks multiplied as stored; None: dequantised)."""

    dtype: torch.dtype
    quantization: str | None

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return dtype if self.quantization is None else f"{self.quantization} ({dtype} activations)"


def resolve_weight_mode(
    dtype: str,
    quantization: str | None,
    path: Path,
    device: torch.device,
    tensor_parallel_size: int = 1,
) -> WeightMode:
    """The mode the settings ``dtype`` ("auto" or a name) and ``quantization`` ("auto", "gguf"
    or None) give for the model at ``path`` on ``device``."""
    if quantization is not None and quantization not in QUANTIZATION_SETTINGS:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATION_SETTINGS)} or None, "
            f"got {quantization!r}"
        )
    torch_dtype = dtype_for(dtype, device)
    if device.type == "cuda" and path.suffix == ".gguf" and quantization != "gguf":
        _report_dequantised_on_cuda(path, torch_dtype)
    if quantization != "auto":
        return WeightMode(torch_dtype, quantization)
    if path.suffix != ".gguf" or device.type != "cpu" or dtype != "auto":
        return WeightMode(torch_dtype, None)  # nothing stored to multiply, or a dtype asked for
    why_not = _why_not_gguf(path, tensor_parallel_size)
    if why_not is None:
        return WeightMode(torch_dtype, "gguf")
    logger.info("quantization='auto': %s: dequantising to float32", why_not)
    return WeightMode(torch_dtype, None)


def _report_dequantised_on_cuda(path: Path, dtype: torch.dtype) -> None:
    """One log line: on CUDA a GGUF file's blocks are dequantised (the block kernels are the
    CPU's)."""
    from specbatch.models.gguf_file import GGUFFile

    with GGUFFile(path) as gguf_file:
        kinds = sorted({t.type_name for t in gguf_file.tensors if t.type_name not in ("F32",)})
    if kinds:
        logger.info(
            "%s on CUDA: its %s tensors are dequantised to %s (the block kernels run on the CPU)",
            path.name,
            ", ".join(kinds),
            str(dtype).removeprefix("torch."),
        )


def dtype_for(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype of the setting ``dtype`` on ``device``."""
    if dtype == "auto":  # GPUs want bf16; bf16 matmuls are slower than float32 on most CPUs
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(dtype)


def _why_not_gguf(path: Path, tensor_parallel_size: int) -> str | None:
    """What keeps the CPU from multiplying ``path``'s blocks fastest as stored, or None."""
    from specbatch.kernels import gguf_blocks, gguf_linear
    from specbatch.models.gguf_checkpoint import first_unsupported_matrix
    from specbatch.models.gguf_file import GGUFFile

    if tensor_parallel_size > 1:
        return "tensor-parallel ranks split float32 weights, not GGUF blocks"
    with GGUFFile(path) as gguf_file:
        unsupported = first_unsupported_matrix(gguf_file)
    if unsupported is not None:
        return unsupported
    isas = {gguf_linear.vector_isa(), gguf_blocks.vector_isa()}
    isa = None if None in isas else min(isas, key=gguf_linear.VECTOR_ISAS.index)
    if isa is None:
        return "the GGUF kernel could not be built here"
    if isa == "plain":
        return "this CPU has neither AVX2 with FMA nor AVX-512 for the GGUF kernel"
    return None
