"""Rewrites a GGUF file with chosen metadata values or tensor shapes, as a damaged or hostile
file would carry them (``tests.gguf_writer`` writes only well-formed files)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

Value = tuple[Any, gguf.GGUFValueType]


def rewrite_gguf(
    path: Path,
    metadata: Mapping[str, Value | None] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    drop: Collection[str] = (),
) -> None:
    """Rewrite ``path`` in place: ``metadata`` sets keys to ``(value, type)`` (``None`` deletes
    one), ``shapes`` declares other numpy-order shapes for tensors whose data stays as it was,
    ``drop`` leaves tensors out. Unquantised (F32/F16) files only."""
    reader = gguf.GGUFReader(path)
    values = _metadata(reader)
    for key, value in (metadata or {}).items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = (*value, None)
    # Copies: the reader maps the file that is about to be rewritten.
    tensors = {t.name: np.array(t.data) for t in reader.tensors if t.name not in drop}
    arch = str(reader.fields["general.architecture"].contents())
    del reader
    _write(path, arch, values, tensors, shapes or {})


def _metadata(
    reader: gguf.GGUFReader,
) -> dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        out[name] = (field.contents(), kind, sub)
    return out


def _write(
    path: Path,
    arch: str,
    values: Mapping[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]],
    tensors: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, kind, sub) in values.items():
        writer.add_key_value(key, value, kind, sub)
    for name, array in tensors.items():
        writer.add_tensor(name, array, raw_shape=shapes.get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
