"""Which attention backend to use: by explicit name, else the best one for the device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specbatch.errors import ConfigError
from specbatch.kernels.attention.base import AttentionBackend


def _cpu_backend() -> type[AttentionBackend]:
    from specbatch.kernels.attention.cpu_paged import CpuPagedBackend

    return CpuPagedBackend


def _torch_backend() -> type[AttentionBackend]:
    from specbatch.kernels.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend


def _dense_causal_backend() -> type[AttentionBackend]:
    from specbatch.kernels.attention.dense_causal import DenseCausalBackend

    return DenseCausalBackend


def _triton_backend() -> type[AttentionBackend]:
    try:
        from specbatch.kernels.attention.triton_backend import TritonAttentionBackend
    except ImportError as exc:
        raise ConfigError(
            f"attention backend 'triton' needs the triton package (pip install triton): {exc}"
        ) from None
    return TritonAttentionBackend


def _flash_attn_backend() -> type[AttentionBackend]:
    from specbatch.kernels.attention.optional_backends import (
        FlashAttnBackend,
        flash_attn_available,
    )

    if not flash_attn_available():
        raise ConfigError("attention backend 'flash_attn' needs CUDA and the flash-attn package")
    return FlashAttnBackend


def _xformers_backend() -> type[AttentionBackend]:
    from specbatch.kernels.attention.optional_backends import XformersBackend, xformers_available

    if not xformers_available():
        raise ConfigError(
            "attention backend 'xformers' needs CUDA and an xformers build with CUDA kernels"
        )
    return XformersBackend


# Imports are deferred so that optional packages (triton, flash-attn, xformers) are only touched
# when their backend is asked for.
_BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "cpu": _cpu_backend,
    "torch": _torch_backend,
    "dense_causal": _dense_causal_backend,
    "triton": _triton_backend,
    "flash_attn": _flash_attn_backend,
    "xformers": _xformers_backend,
}


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def available_backends() -> list[str]:
    """Names accepted by :func:`attention_backend_class`."""
    return sorted(_BACKENDS)


def _default_name(device: torch.device) -> str:
    """Triton on CUDA (torch where it is missing), the in-place C kernel on the CPU (which
    keeps the torch reference path itself where no C compiler works)."""
    if device.type == "cuda":
        return "triton" if _importable("triton") else "torch"
    return "cpu"


def attention_backend_class(name: str | None, device: torch.device) -> type[AttentionBackend]:
    """Return the backend called ``name``, or the default for ``device`` when ``name`` is None."""
    if name is None:
        name = _default_name(device)
    if name not in _BACKENDS:
        raise ConfigError(
            f"unknown attention backend {name!r}; available: {', '.join(available_backends())}"
        )
    return _BACKENDS[name]()
