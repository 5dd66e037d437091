"""Paged attention through flash-attn or xformers, when installed with CUDA support.

Neither package has a CUDA build on PyPI for this stack, so both are optional: the registry
offers them by name only when they import with CUDA kernels, and their tests skip otherwise.
K/V are written into the paged cache with ``index_copy_`` (slot -1 skipped); attention reads the
cache through the block table with the causal offset aligned bottom-right (query ``i`` of a
sequence sees keys up to ``seq_len - query_len + i``), the semantics of every backend here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specbatch.errors import ConfigError
from specbatch.kernels.attention.base import (
    PAD_SLOT,
    AttentionBackend,
    AttentionInputs,
    LayerKVCache,
)


@dataclass
class VarlenMetadata:
    query_lens: list[int]
    seq_lens: list[int]
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    block_tables: torch.Tensor  # [B, max_blocks] int32
    write_rows: torch.Tensor  # tokens whose K/V are written
    write_slots: torch.Tensor
    block_size: int


def _varlen_metadata(inputs: AttentionInputs, device: torch.device) -> VarlenMetadata:
    if inputs.tree_mask is not None:
        raise ConfigError("this attention backend has no tree mask; use 'triton' or 'torch'")
    slots = np.asarray(inputs.slot_mapping, dtype=np.int64)
    written = np.flatnonzero(slots != PAD_SLOT)

    def cumulative(values: np.ndarray) -> torch.Tensor:
        out = np.concatenate([[0], np.cumsum(values)]).astype(np.int32)
        return torch.from_numpy(out).to(device)

    return VarlenMetadata(
        query_lens=inputs.query_lens.tolist(),
        seq_lens=inputs.seq_lens.tolist(),
        cu_seqlens_q=cumulative(inputs.query_lens),
        cu_seqlens_k=cumulative(inputs.seq_lens),
        max_query_len=int(inputs.query_lens.max(initial=1)),
        max_seq_len=int(inputs.seq_lens.max(initial=1)),
        block_tables=torch.from_numpy(inputs.block_tables.astype(np.int32)).to(device),
        write_rows=torch.from_numpy(written).to(device),
        write_slots=torch.from_numpy(slots[written]).to(device),
        block_size=inputs.block_size,
    )


def _write(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, m: VarlenMetadata) -> None:
    key_cache, value_cache = cache
    heads, dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, heads, dim).index_copy_(0, m.write_slots, k.index_select(0, m.write_rows))
    value_cache.view(-1, heads, dim).index_copy_(0, m.write_slots, v.index_select(0, m.write_rows))


class FlashAttnBackend(AttentionBackend):
    """``flash_attn_varlen_func`` with ``block_table`` (paged KV; block size a multiple of 256)."""

    name = "flash_attn"

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> VarlenMetadata:
        if inputs.block_size % 256:
            raise ConfigError("the flash_attn backend needs block_size to be a multiple of 256")
        return _varlen_metadata(inputs, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache | None,
        metadata: VarlenMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        assert kv_cache is not None
        _write(k, v, kv_cache, metadata)
        return flash_attn_varlen_func(
            q.contiguous(),
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=metadata.cu_seqlens_q,
            cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
            block_table=metadata.block_tables,
        )


class XformersBackend(AttentionBackend):
    """xformers memory-efficient attention with a paged block-diagonal causal-offset mask."""

    name = "xformers"

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> VarlenMetadata:
        return _varlen_metadata(inputs, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache | None,
        metadata: VarlenMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        from xformers.ops import fmha

        if window is not None:
            raise ValueError("the xformers backend has no sliding window: use the default one")

        assert kv_cache is not None
        _write(k, v, kv_cache, metadata)
        bias = fmha.attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_seqlen=metadata.query_lens,
            kv_seqlen=metadata.seq_lens,
            block_tables=metadata.block_tables,
            page_size=metadata.block_size,
            device=q.device,
        )
        tokens, group = q.shape[0], self.num_heads // self.num_kv_heads
        blocks, block_size = kv_cache[0].shape[:2]

        def paged(cache: torch.Tensor) -> torch.Tensor:  # [1, N, kv_heads, group, dim]
            flat = cache.view(1, blocks * block_size, self.num_kv_heads, 1, self.head_dim)
            return flat.expand(-1, -1, -1, group, -1)

        out = fmha.memory_efficient_attention_forward(
            q.reshape(1, tokens, self.num_kv_heads, group, self.head_dim),
            paged(kv_cache[0]),
            paged(kv_cache[1]),
            attn_bias=bias,
            scale=self.scale,
        )
        return out.reshape(tokens, self.num_heads, self.head_dim)


def flash_attn_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError:
        return False
    return True


def xformers_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from xformers.ops import fmha
    except ImportError:
        return False
    return hasattr(fmha.attn_bias, "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask")
