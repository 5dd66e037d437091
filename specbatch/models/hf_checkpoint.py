"""Reading a HF model directory: ``config.json`` and one or many ``*.safetensors`` files."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeGuard

import torch
from safetensors import safe_open

from specbatch.errors import ModelLoadError
from specbatch.models.config import ModelConfig
from specbatch.models.inventory import DeclaredTensor, Shape, check_inventory
from specbatch.models.llama import IGNORED_SUFFIXES

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: not a model directory (no config.json)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot parse JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    try:
        return ModelConfig.from_hf_dict(raw)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a directory, from the index file when there is one."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: invalid index file ({exc})") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index}: lists weight files that do not exist: {absent}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{directory}: no *.safetensors weights (pickle checkpoints such as *.bin are never "
            "loaded; convert them to safetensors)"
        )
    return files


def check_safetensors_tensors(files: list[Path], config: ModelConfig, directory: Path) -> None:
    """Check the safetensors headers against ``config`` (see :mod:`specbatch.models.inventory`)."""
    declared: dict[str, DeclaredTensor] = {}
    for path in files:
        for name, shape in _header_shapes(path):
            if name.endswith(IGNORED_SUFFIXES) or (
                name == "lm_head.weight" and config.tie_word_embeddings
            ):
                continue  # never loaded (see LlamaForCausalLM.load_weights)
            if name in declared:
                raise ModelLoadError(f"{path}: tensor {name!r} is also in {declared[name].file}")
            declared[name] = DeclaredTensor(name, shape, str(path))
    check_inventory(config, declared, str(directory), "num_hidden_layers in config.json")


def _header_shapes(path: Path) -> list[tuple[str, Shape]]:
    """Names and shapes from a safetensors header; no tensor data is read."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
            return [(name, tuple(handle.get_slice(name).get_shape())) for name in names]
    except Exception as exc:  # safetensors raises its own error types and OSError
        raise _unreadable(path, exc) from None


def _unreadable(path: Path, exc: Exception) -> ModelLoadError:
    detail = _inconsistent_entry(path) or str(exc)
    return ModelLoadError(f"{path}: cannot read safetensors file (truncated or corrupt?): {detail}")


# Bytes per element of the dtypes checkpoints use; others are left to the library's own message.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def _inconsistent_entry(path: Path) -> str | None:
    """Which header entry is at fault, for a file the library refused: its messages name no
    tensor ("invalid shape, data type, or offset for tensor"). ``None`` when none is found."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > _MAX_HEADER_BYTES:
                return None
            header = json.loads(handle.read(length))
        entries = [(k, v) for k, v in header.items() if k != "__metadata__"]
    except (OSError, struct.error, ValueError, AttributeError):
        return None
    return next((bad for name, entry in entries if (bad := _entry_fault(name, entry))), None)


def _entry_fault(name: str, entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return f"tensor {name!r} has no valid header entry"
    shape, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
    if not _naturals(shape):
        return f"tensor {name!r} has shape {shape!r}"
    if dtype not in _DTYPE_BYTES or not _naturals(offsets) or len(offsets) != 2:
        return None
    declared = math.prod(shape) * _DTYPE_BYTES[dtype]
    stored = offsets[1] - offsets[0]
    if declared != stored:
        return (
            f"tensor {name!r} has shape {tuple(shape)} of {dtype} ({declared} bytes), "
            f"but its data spans {stored} bytes"
        )
    return None


def _naturals(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield ``(name, tensor, file)`` one tensor at a time; a damaged file names itself."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, handle.get_tensor(name), str(path)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types and OSError
            raise _unreadable(path, exc) from None
