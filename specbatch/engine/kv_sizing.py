"""How many KV-cache blocks to allocate, from the configuration and the device's memory."""

from __future__ import annotations

import torch

from specbatch.cache.kv_tensors import allocate_kv_caches, kv_bytes_per_block
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError
from specbatch.models.config import ModelConfig
from specbatch.models.llama import LlamaForCausalLM
from specbatch.utils import ceil_div

# The CPU cache's reservation when nothing says otherwise (vLLM's CPU default, 4 GiB); memory is
# committed only as blocks are used.
DEFAULT_CPU_KV_CACHE_GIB = 4.0


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


def profile_activation_bytes(
    model: LlamaForCausalLM, num_tokens: int, num_logit_rows: int, block_size: int
) -> int:
    """Peak CUDA memory of one forward of ``num_tokens`` tokens (0 off CUDA): what the KV
    cache must leave free."""
    if model.device.type != "cuda":
        return 0
    from specbatch.runner.flat_batch import TokenRun, flatten

    blocks = ceil_div(num_tokens, block_size)
    model.bind_kv_caches(
        allocate_kv_caches(model.config, blocks, block_size, model.dtype, model.device)
    )
    torch.cuda.synchronize(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    baseline = torch.cuda.memory_allocated(model.device)
    batch = flatten([TokenRun([0] * num_tokens, 0, list(range(blocks)))], block_size)
    metadata = model.backend.build_metadata(batch.attention, model.device)
    with torch.no_grad():
        hidden = model(
            torch.from_numpy(batch.input_ids).to(model.device),
            torch.from_numpy(batch.positions).to(model.device),
            metadata,
        )
        model.compute_logits(hidden[-min(num_logit_rows, num_tokens) :])
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device) - baseline
    model.bind_kv_caches([(torch.empty(0), torch.empty(0))] * model.config.num_hidden_layers)
    torch.cuda.empty_cache()
    return int(peak)


def choose_num_kv_blocks(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    lookahead: int,
    extra_bytes_per_block: int = 0,
    reserved_bytes: int = 0,
) -> int:
    """Blocks for the cache: explicit (``num_kv_blocks`` or ``kv_cache_gib``), or sized from
    free memory, never more than ``max_num_seqs`` full-length sequences need. Fails at start-up
    if one sequence cannot fit.

    ``extra_bytes_per_block`` accounts for a draft model's cache, which shares the block ids;
    ``reserved_bytes`` is memory the forward passes need (see ``profile_activation_bytes``).
    """
    block_size = config.block_size
    per_block = kv_bytes_per_block(model_config, block_size, dtype) + extra_bytes_per_block
    blocks_per_seq = ceil_div(max_model_len + lookahead, block_size)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_gib is not None:
        num_blocks = int(config.kv_cache_gib * (1 << 30)) // per_block
    else:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.kv_cache_memory_fraction) - reserved_bytes
        else:
            budget = min(
                int(available_host_memory() * config.kv_cache_memory_fraction),
                int(DEFAULT_CPU_KV_CACHE_GIB * (1 << 30)),
            )
        num_blocks = min(budget // per_block, config.max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            f"the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one sequence "
            f"of max_model_len={max_model_len} tokens (+{lookahead} draft slots): lower "
            "max_model_len or give the cache more memory (num_kv_blocks / kv_cache_gib)"
        )
    return num_blocks
