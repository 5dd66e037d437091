"""Arithmetic shared by every room of the package."""

from __future__ import annotations

from typing import TypeVar

import numpy as np

Count = TypeVar("Count", int, np.ndarray)


def ceil_div(numerator: Count, denominator: int) -> Count:
    """``ceil(numerator / denominator)`` in exact integer arithmetic (elementwise for arrays)."""
    return -(-numerator // denominator)
