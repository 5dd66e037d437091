"""The physical paged K/V tensors of a model, one (key, value) pair per layer."""

from __future__ import annotations

import math
import mmap

import torch

from specbatch.kernels.attention import LayerKVCache
from specbatch.models.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return config.kv_bytes_per_token(dtype) * block_size


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    window_blocks: int | None = None,
) -> list[LayerKVCache]:
    """Zeroed ``[num_blocks, block_size, kv_heads, head_dim]`` key and value tensors per layer
    (``window_blocks`` for each sliding-window layer, where they have their own cache group).

    Zeros, not garbage: padded attention columns are masked, but a NaN in masked memory would
    still poison ``0 * NaN`` in the value product. On the CPU the zeros cost nothing until used:
    each tensor is an anonymous memory map, whose pages the kernel provides zeroed on first
    write, so the process holds the blocks it has used, not the whole reservation.
    """

    def zeros(blocks: int) -> torch.Tensor:
        shape = (blocks, block_size, config.num_key_value_heads, config.head_dim)
        if torch.device(device).type == "cpu":
            return lazy_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    def blocks_of(layer: int) -> int:
        windowed = window_blocks is not None and config.layer_window(layer) is not None
        return window_blocks if windowed and window_blocks is not None else num_blocks

    return [(zeros(blocks_of(i)), zeros(blocks_of(i))) for i in range(config.num_hidden_layers)]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose memory is committed page by page as it is written (an
    anonymous map: unlike ``torch.zeros``, nothing is touched up front). The tensor keeps the
    map alive; it is unmapped when the tensor is freed."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # private: counted as the process's own (anonymous) memory, never shared with a fork
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(shape)


def move_slots(caches: list[LayerKVCache], sources: torch.Tensor, targets: torch.Tensor) -> None:
    """Copy the K/V of cache slots ``sources`` to ``targets`` in every layer, in place.

    A tree's accepted path was written at the slots of its nodes' indices in the tree; this
    moves it to the sequence's contiguous positions (its K/V were computed at the rotary
    positions of their depths, which are those positions). Every source is read before any
    target is written, so moves that overlap (a path node moving onto a slot another node
    leaves) are safe. Slots are ``block * block_size + offset``; a slot must not be both the
    target of one move and the source of a later one that should see the old value.
    """
    if not len(sources):
        return
    if len(sources) != len(targets):
        raise ValueError("move_slots needs one target slot per source slot")
    for key_cache, value_cache in caches:
        for cache in (key_cache, value_cache):
            flat = cache.view(-1, *cache.shape[2:])
            flat[targets.to(cache.device)] = flat[sources.to(cache.device)]
