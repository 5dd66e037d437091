"""Paged attention backends behind one interface, chosen by name or by device."""

from specbatch.kernels.attention.base import (
    PAD_SLOT,
    AttentionBackend,
    AttentionInputs,
    GroupedMetadata,
    LayerKVCache,
)
from specbatch.kernels.attention.registry import attention_backend_class, available_backends

__all__ = [
    "PAD_SLOT",
    "AttentionBackend",
    "AttentionInputs",
    "GroupedMetadata",
    "LayerKVCache",
    "attention_backend_class",
    "available_backends",
]
