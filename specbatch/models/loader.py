"""The one entry point that turns a model name, directory or GGUF file into a ready model."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from specbatch.errors import ConfigError, ModelLoadError
from specbatch.kernels.attention import attention_backend_class
from specbatch.kernels.block_forms import BLOCK_FORMS
from specbatch.kernels.linear import Linear
from specbatch.models.config import ModelConfig
from specbatch.models.default_model import default_model_path, is_default_model_name
from specbatch.models.families import hf_norm_shift
from specbatch.models.gguf_checkpoint import (
    check_gguf_tensors,
    iter_gguf_quantized,
    iter_gguf_tensors,
    read_gguf_config,
)
from specbatch.models.gguf_file import GGUFFile
from specbatch.models.hf_checkpoint import (
    check_safetensors_tensors,
    iter_safetensors,
    read_hf_config,
    safetensors_files,
)
from specbatch.models.llama import LlamaForCausalLM
from specbatch.models.registry import model_class

logger = logging.getLogger("specbatch")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept a torch dtype or its usual name (``float32``, ``bfloat16``, ``float16``)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(
            f"dtype {dtype!r} is not supported; use one of {', '.join(sorted(_DTYPES))}"
        ) from None


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """A local directory or ``.gguf`` path; ``None`` or the default's name fetch the default."""
    if model is None or (isinstance(model, str) and is_default_model_name(model)):
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.is_file():
        raise ModelLoadError(f"{path}: expected a model directory or a .gguf file")
    raise ModelLoadError(
        f"{path}: no such model directory or .gguf file (specbatch never reaches a model hub; "
        "give a local path, or no model for the default SmolLM2-135M-Instruct)"
    )


def load_config(path: Path) -> ModelConfig:
    """The :class:`ModelConfig` of a resolved model path."""
    if path.suffix == ".gguf":
        with GGUFFile(path) as gguf_file:
            return read_gguf_config(gguf_file)
    return read_hf_config(path)


def load_model(
    model: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attention_backend: str | None = None,
    quantization: str | None = None,
    shard: ShardSpec | None = None,
) -> LlamaForCausalLM:
    """Load a model from a HF directory (safetensors) or a GGUF file, dequantised to ``dtype``.

    ``model`` is a directory, a ``.gguf`` path, or ``None`` for the default model. Errors name the
    file and tensor at fault (:class:`~specbatch.errors.ModelLoadError`); the header and the
    tensor directory are checked against each other before any weight memory is allocated.
    ``quantization="gguf"`` keeps a GGUF file's Q4_1 and Q8_0 matrices as they are stored and
    multiplies with them directly (CPU, float32 activations; see ``kernels.gguf_linear``).
    ``shard=(rank, world_size)`` loads that rank's tensor-parallel slice only (see
    :mod:`specbatch.models.tensor_parallel`; the process group must be up before its first forward).
    """
    path = resolve_model_path(model)
    torch_dtype = parse_dtype(dtype)
    torch_device = torch.device(device)
    check_quantization(quantization, path, torch_dtype, torch_device)
    if path.suffix == ".gguf":
        with GGUFFile(path) as gguf_file:
            config = read_gguf_config(gguf_file)
            check_gguf_tensors(gguf_file, config)
            net = _build(
                config,
                lambda skip: iter_gguf_tensors(gguf_file, config, skip),
                path,
                torch_dtype,
                torch_device,
                attention_backend,
                iter_gguf_quantized(gguf_file, config) if quantization == "gguf" else None,
                shard,
            )
            if quantization == "gguf":
                _report_quantized(net, gguf_file)
            return net
    config = read_hf_config(path)
    files = safetensors_files(path)
    check_safetensors_tensors(files, config, path)
    return _build(
        config,
        lambda skip: _hf_weights(iter_safetensors(files), config),
        path,
        torch_dtype,
        torch_device,
        attention_backend,
        shard=shard,
    )


def _hf_weights(
    tensors: Iterable[tuple[str, torch.Tensor, str]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """A HF checkpoint's tensors as the model holds them: Gemma's norm weights w as 1 + w (in
    float32, as transformers adds them), which GGUF files already store."""
    shift = hf_norm_shift(config.architecture)
    for name, tensor, origin in tensors:
        if shift and name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor, origin


ShardSpec = tuple[int, int]  # (rank, world size)
QUANTIZATIONS = ("gguf",)


def _report_quantized(net: LlamaForCausalLM, gguf_file: GGUFFile) -> None:
    """One log line on what ``quantization="gguf"`` kept as blocks, and a warning naming the
    first tensor (and its type) it had to dequantise instead."""
    linears = [m for m in net.modules() if isinstance(m, Linear)]
    kept = sum(not m.dense for m in linears)
    other = [t for t in gguf_file.tensors if len(t.shape) == 2 and t.type_name not in BLOCK_FORMS]
    if kept < len(linears) and other:
        logger.warning(
            "quantization='gguf': %d of %d linear layers multiply GGUF blocks; the others are "
            "dequantised to float32 (%s is %s, which the kernels do not multiply)",
            kept,
            len(linears),
            other[0].name,
            other[0].type_name,
        )
    else:
        logger.info(
            "quantization='gguf': %d of %d linear layers multiply GGUF blocks", kept, len(linears)
        )


def check_quantization(
    quantization: str | None, path: Path, dtype: torch.dtype, device: torch.device
) -> None:
    """Refuse a quantization the model file, dtype or device cannot serve."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {quantization!r}"
        )
    if path.suffix != ".gguf":
        raise ConfigError(
            f"quantization='gguf' multiplies with a GGUF file's quantized blocks; {path} is not "
            "a .gguf file"
        )
    if device.type != "cpu":
        raise ConfigError(f"quantization='gguf' runs on the CPU only, not on {device}")
    if dtype != torch.float32:
        raise ConfigError(
            "quantization='gguf' computes in float32 with the file's exact values; "
            f"use dtype float32 (or auto), not {str(dtype).removeprefix('torch.')}"
        )


def _build(
    config: ModelConfig,
    weights: Callable[[set[str]], Iterable[tuple[str, torch.Tensor, str]]],
    path: Path,
    torch_dtype: torch.dtype,
    torch_device: torch.device,
    attention_backend: str | None,
    quantized: Iterable[tuple[str, str, np.ndarray]] | None = None,
    shard: ShardSpec | None = None,
) -> LlamaForCausalLM:
    """The model with ``weights(skip)`` loaded, where ``skip`` names the tensors kept as GGUF
    blocks (``quantized``), which are neither allocated nor dequantised in plain form; with
    ``shard``, a tensor-parallel rank's slice of it."""
    cls = model_class(config.architecture)
    plan = None
    built = config
    if shard is not None and shard[1] > 1:
        from specbatch.models.tensor_parallel import ShardPlan

        if quantized is not None:
            raise ConfigError("quantization='gguf' cannot be split over tensor-parallel ranks")
        plan = ShardPlan(config, *shard)
        built = plan.local_config()
    backend_cls = attention_backend_class(attention_backend, torch_device)
    backend = backend_cls(
        built.num_attention_heads, built.num_key_value_heads, built.head_dim, built.query_scale
    )
    backend.softcap = built.attn_logit_softcap
    with torch.device("meta"):
        net = cls(built, backend)
    skip = net.use_quantized_weights(quantized) if quantized is not None else set()
    net = net.to(dtype=torch_dtype).to_empty(device=torch_device)
    tensors = weights(skip)
    if plan is not None:
        tensors = plan.shard_weights(tensors)
    with torch.no_grad():
        net.load_weights(tensors, source=str(path))
    if plan is not None:
        from specbatch.models.tensor_parallel import TensorParallel

        net.shard_over(TensorParallel(plan))
    net.eval()
    net.requires_grad_(False)
    return net
