"""Reading a HF model directory: ``config.json`` and one or many ``*.safetensors`` files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from specbatch.errors import ModelLoadError
from specbatch.models.config import ModelConfig

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
            raise ModelLoadError(
                f"{path}: cannot read safetensors file (truncated or corrupt?): {exc}"
            ) from None
