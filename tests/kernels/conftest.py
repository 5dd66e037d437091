"""Kernel tests run Triton kernels on CPU tensors through the interpreter when there is no GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
