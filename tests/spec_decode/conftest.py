"""Fixtures shared by the speculative-decoding tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import write_tiny_model
from tests.spec_decode.distribution import V


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("dist")
    target = write_tiny_model(base / "target", seed=10, vocab_size=V)
    draft = write_tiny_model(base / "draft", seed=11, vocab_size=V)
    return target, draft
