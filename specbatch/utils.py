"""Small helpers shared by every room of the package: integer arithmetic, the user cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

import numpy as np

Count = TypeVar("Count", int, np.ndarray)


def ceil_div(numerator: Count, denominator: int) -> Count:
    """``ceil(numerator / denominator)`` in exact integer arithmetic (elementwise for arrays)."""
    return -(-numerator // denominator)


def cache_dir() -> Path:
    """``$SPECBATCH_CACHE``, else ``$XDG_CACHE_HOME/specbatch``, else ``~/.cache/specbatch``:
    where the default model and compiled kernels are kept."""
    override = os.environ.get("SPECBATCH_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specbatch"
