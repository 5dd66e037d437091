"""The physical paged K/V tensors of a model, one (key, value) pair per layer."""

from __future__ import annotations

import torch

from specbatch.kernels.attention import LayerKVCache
from specbatch.models.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[LayerKVCache]:
    """Zeroed ``[num_blocks, block_size, kv_heads, head_dim]`` key and value tensors per layer.

    Zeros, not garbage: padded attention columns are masked, but a NaN in masked memory would
    still poison ``0 * NaN`` in the value product.
    """
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]
