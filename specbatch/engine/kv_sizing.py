"""How many KV-cache blocks to allocate, from the configuration and the device's memory."""

from __future__ import annotations

import torch

from specbatch.cache.kv_tensors import kv_bytes_per_block
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError
from specbatch.models.config import ModelConfig


def available_host_memory() -> int:
    """Bytes of RAM the kernel reports as available (MemAvailable), or 4 GiB if unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def release_freed_memory() -> None:
    """Hand memory freed by the C allocator back to the OS (glibc keeps large freed chunks)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def choose_num_kv_blocks(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    lookahead: int,
    extra_bytes_per_block: int = 0,
) -> int:
    """Blocks for the cache: explicit, or sized from free memory, never more than
    ``max_num_seqs`` full-length sequences need. Fails at start-up if one sequence cannot fit.

    ``extra_bytes_per_block`` accounts for a draft model's cache, which shares the block ids.
    """
    block_size = config.block_size
    per_block = kv_bytes_per_block(model_config, block_size, dtype) + extra_bytes_per_block
    blocks_per_seq = -(-(max_model_len + lookahead) // block_size)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.kv_cache_memory_fraction)
        else:
            budget = min(
                int(available_host_memory() * config.kv_cache_memory_fraction),
                int(config.kv_cache_max_gib * (1 << 30)),
            )
        num_blocks = min(budget // per_block, config.max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            f"the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one sequence "
            f"of max_model_len={max_model_len} tokens (+{lookahead} draft slots): lower "
            "max_model_len or give the cache more memory (num_kv_blocks / kv_cache_max_gib)"
        )
    return num_blocks
