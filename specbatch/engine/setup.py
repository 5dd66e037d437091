"""Building an engine's parts: models, tokenizer, KV cache of the right size, CUDA graphs."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specbatch.cache.kv_tensors import allocate_kv_caches, kv_bytes_per_block
from specbatch.config import EngineConfig
from specbatch.engine.kv_sizing import (
    choose_num_kv_blocks,
    profile_activation_bytes,
    release_freed_memory,
)
from specbatch.models import load_model, resolve_model_path
from specbatch.models.llama import LlamaForCausalLM
from specbatch.models.weight_mode import WeightMode
from specbatch.parallel.world import ranks_on_this_host
from specbatch.spec_decode.config import SpeculativeConfig
from specbatch.spec_decode.factory import load_draft_model
from specbatch.spec_decode.proposers.head import EagleHead
from specbatch.spec_decode.proposers.shipped import drafts_for, shipped_draft_available
from specbatch.tokenizer import Tokenizer, load_tokenizer
from specbatch.utils import ceil_div

logger = logging.getLogger("specbatch")

if TYPE_CHECKING:
    from specbatch.runner.cuda_graphs import Capture, CudaGraphRunner


@dataclass
class Models:
    """The loaded target (and draft), on their device, with the step limits they imply."""

    device: torch.device
    weight_mode: WeightMode
    model_path: Path
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    draft: LlamaForCausalLM | EagleHead | None
    max_model_len: int
    num_speculative_tokens: int
    speculation: SpeculativeConfig | None  # "auto" resolved

    @property
    def dtype(self) -> torch.dtype:
        return self.weight_mode.dtype


def load_models(config: EngineConfig) -> Models:
    """The target (rank 0's slice under tensor parallelism), tokenizer and draft."""
    world = config.tensor_parallel_size
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    elif world > 1:  # the ranks on this host share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_this_host(world)))
    device = config.resolved_device()
    path = resolve_model_path(config.model)
    mode = config.weight_mode(path, device)
    dtype = mode.dtype
    model = load_model(
        path,
        dtype,
        device,
        config.attention_backend,
        mode.quantization,
        shard=(0, world) if world > 1 else None,
    )
    if config.cpu_weight_packing and model.pack_for_cpu():
        release_freed_memory()  # the plain weights just dropped
    tokenizer = load_tokenizer(config.tokenizer or path)
    positions = model.config.max_position_embeddings
    spec = config.speculation
    if spec is not None:
        fits = shipped_draft_available() and drafts_for(model.config, tokenizer)
        spec = spec.resolved(fits)
        if "sliding" in model.config.layer_types:
            spec = spec.chains_only("the model's sliding-window layers")
    draft = None
    if spec is not None:
        draft = load_draft_model(
            spec,
            model,
            tokenizer,
            dtype,
            device,
            attention_backend=config.attention_backend,
            packed=config.cpu_weight_packing,
        )
        if draft is not None and config.cpu_weight_packing:
            draft.pack_for_cpu()
    return Models(
        device,
        mode,
        path,
        model,
        tokenizer,
        draft,
        max_model_len=min(config.max_model_len or positions, positions),
        num_speculative_tokens=spec.k if spec else 0,
        speculation=spec,
    )


def window_group_blocks(config: EngineConfig, models: Models, num_blocks: int) -> int | None:
    """The sliding-window layers' own pool (``cache/window_cache.py``): blocks enough for
    ``max_num_seqs`` sequences' windows plus a step's chunk and drafts each, at most the full
    pool's; None where they share the full pool (no sliding layer; tensor-parallel ranks and
    CUDA graphs keep one table per sequence)."""
    model_config = models.model.config
    window = model_config.sliding_window
    if (
        window is None
        or "sliding" not in model_config.layer_types
        or models.model.tp is not None
        or models.device.type != "cpu"
    ):
        return None
    span = window - 1 + config.max_num_batched_tokens + models.num_speculative_tokens
    per_sequence = ceil_div(span, config.block_size) + 1
    return min(num_blocks, config.max_num_seqs * per_sequence)


def allocate_cache(config: EngineConfig, models: Models) -> tuple[int, int | None]:
    """Size the paged cache from the budget, allocate it, bind it to the target; its block
    count, and the sliding layers' own pool's (None: they share it)."""
    k = models.num_speculative_tokens
    draft_bytes = 0  # what the draft keeps per block beside the target's K/V
    if models.draft is not None:
        draft_bytes = models.draft.cache_bytes_per_block(config.block_size)
    reserved = 0
    if models.model.tp is None:  # a sharded model's forward needs every rank
        reserved = profile_activation_bytes(
            models.model,
            config.max_num_batched_tokens,
            config.max_num_seqs * (k + 1),
            config.block_size,
        )
    cache_config = models.model.local_config  # this rank's heads
    num_blocks = choose_num_kv_blocks(
        config,
        cache_config,
        models.dtype,
        models.device,
        models.max_model_len,
        lookahead=k,
        extra_bytes_per_block=draft_bytes,
        reserved_bytes=reserved,
    )
    window_blocks = window_group_blocks(config, models, num_blocks)
    models.model.bind_kv_caches(
        allocate_kv_caches(
            cache_config, num_blocks, config.block_size, models.dtype, models.device, window_blocks
        )
    )
    per_block = kv_bytes_per_block(cache_config, config.block_size, models.dtype)
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens), %.2f GiB reserved on %s%s",
        num_blocks,
        config.block_size,
        num_blocks * config.block_size,
        num_blocks * (per_block + draft_bytes) / (1 << 30),
        models.device,
        ", committed as blocks are first used" if models.device.type == "cpu" else "",
    )
    if window_blocks is not None:
        logger.info(
            "KV cache of the sliding-window layers: %d blocks (their window of %d positions "
            "kept per sequence)",
            window_blocks,
            models.model.config.sliding_window,
        )
    return num_blocks, window_blocks


def capture_graphs(config: EngineConfig, models: Models) -> CudaGraphRunner | None:
    """CUDA graphs for decode (and verify, with k drafts) steps, unless disabled."""
    return graph_runner(config, models) if _graphable(models.model, config) else None


def graph_runner(
    config: EngineConfig, models: Models, capture: Capture | None = None
) -> CudaGraphRunner:
    """The captured graphs for this engine's step shapes (``capture``: see CudaGraphRunner)."""
    k = models.num_speculative_tokens
    return _captured(models.model, config, models, (1,) if k == 0 else (1, k + 1), capture)


def capture_draft_graphs(config: EngineConfig, models: Models) -> CudaGraphRunner | None:
    """Graphs for the draft model's single-token forwards (its drafts after the first), when
    the target runs graphs. Call once the draft's KV cache is bound. (A draft head runs
    eagerly: one layer.)"""
    draft = models.draft
    if not isinstance(draft, LlamaForCausalLM) or not _graphable(draft, config):
        return None
    return draft_graph_runner(config, models)


def _graphable(model: LlamaForCausalLM, config: EngineConfig) -> bool:
    """Graphs are captured on CUDA, unless disabled, for a backend that supports them (the
    device is checked first: nothing optional is imported on the CPU)."""
    return (
        model.device.type == "cuda"
        and not config.enforce_eager
        and config.tensor_parallel_size == 1
        and model.backend.supports_cuda_graphs
    )


def draft_graph_runner(
    config: EngineConfig, models: Models, capture: Capture | None = None
) -> CudaGraphRunner:
    assert isinstance(models.draft, LlamaForCausalLM)
    return _captured(models.draft, config, models, (1,), capture)


def _captured(
    model: LlamaForCausalLM,
    config: EngineConfig,
    models: Models,
    query_lens: tuple[int, ...],
    capture: Capture | None,
) -> CudaGraphRunner:
    from specbatch.runner.cuda_graphs import CudaGraphRunner

    k, bs = models.num_speculative_tokens, config.block_size
    runner = CudaGraphRunner(
        model, bs, ceil_div(models.max_model_len + k, bs), query_lens, config.max_num_seqs, capture
    )
    runner.capture()
    return runner
