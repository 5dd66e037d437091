"""Kernel tests run Triton kernels on CPU tensors through the interpreter when there is no GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Restores torch's thread count, which the test may set (to compare thread counts)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
