"""The Triton paged-attention backend (CUDA default; runs on CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specbatch.kernels.attention.base import (
    PAD_SLOT,
    AttentionBackend,
    AttentionInputs,
    LayerKVCache,
)
from specbatch.kernels.attention.triton_kernels import (
    paged_attention_kernel,
    reduce_splits_kernel,
    write_kv_kernel,
)
from specbatch.utils import ceil_div

_MIN_ROWS = 16  # tl.dot needs at least 16 rows
# The interpreter's tl.dot mishandles bfloat16 (numpy has no such type): upcast tiles there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_LONG_CONTEXT = 2048  # split-KV is considered from this many KV positions on
_MAX_SPLITS = 16


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TileConfig:
    """How one attention launch is cut: query rows per program, KV tile, warps, pipeline depth.

    ``rows`` is a target for ``BLOCK_M`` (the backend raises it to hold a whole GQA group).
    The defaults were chosen from the compiled code for sm_80/sm_90 (no register spills, KV loads
    pipelined through ``cp.async``, ``wgmma`` for prefill tiles on sm_90; see
    ``tests/kernels/test_triton_compile.py``); ``benchmarks/gpu_check.py`` times alternatives.
    """

    rows: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


# Steps whose queries are short (decodes, small verifies): few rows, long KV tiles.
DECODE_TILES = TileConfig(rows=_MIN_ROWS, block_n=64)
# Steps with a prefill chunk or long verifies: FlashAttention-style square-ish tiles.
PREFILL_TILES = TileConfig(rows=64, block_n=32)
# ... for heads wider than 128 (Gemma's 256): twice the warps, so that the 64 x 256 float32
# accumulator fits the registers (4 warps spilled 80 bytes a thread on sm_80)
WIDE_PREFILL_TILES = TileConfig(rows=64, block_n=32, num_warps=8)
# What benchmarks/gpu_check.py times against the defaults (each compiles unspilled for sm_90).
TILE_CANDIDATES = {
    "decode": [
        DECODE_TILES,
        TileConfig(16, 32),
        TileConfig(16, 64, num_warps=8),
        TileConfig(16, 128, num_warps=8),
        TileConfig(16, 32, num_stages=4),
        TileConfig(16, 128, num_warps=8, num_stages=4),
    ],
    "prefill": [
        PREFILL_TILES,
        TileConfig(64, 64),
        TileConfig(128, 32, num_warps=8),
        TileConfig(128, 64, num_warps=8),
        TileConfig(64, 64, num_stages=2),
        TileConfig(128, 64, num_warps=8, num_stages=2),
        TileConfig(128, 128, num_warps=8, num_stages=2),
    ],
}


@dataclass
class KernelLaunch:
    """One Triton launch, kept as data so tests can compile exactly what would run."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constants: dict[str, Any]  # constexpr arguments
    num_warps: int = 4
    num_stages: int = 3

    def __call__(self) -> None:
        self.kernel[self.grid](
            *self.args, num_warps=self.num_warps, num_stages=self.num_stages, **self.constants
        )


@dataclass
class TritonMetadata:
    """Device tensors of one step for :class:`TritonAttentionBackend`."""

    query_start: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    kv_lens: torch.Tensor  # [B] int32: seq_lens less trailing fillers
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    program_seq: torch.Tensor  # [P] int32: the sequence of each query-block program
    program_qstart: torch.Tensor  # [P] int32: its first query index in that sequence
    tree_mask: torch.Tensor | None  # [T, max_query_len] int8
    block_size: int
    block_q: int
    block_m: int
    num_splits: int
    tiles: TileConfig


class TritonAttentionBackend(AttentionBackend):
    """Paged FlashAttention-style attention; one kernel for prefill, decode and verify."""

    name = "triton"
    supports_cuda_graphs = True
    decode_tiles = DECODE_TILES
    prefill_tiles = PREFILL_TILES
    force_splits: int | None = None  # tests pin the split-KV path
    long_context = _LONG_CONTEXT  # split-KV is considered from this many KV positions on

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> TritonMetadata:
        group = self.num_heads // self.num_kv_heads
        max_query = int(inputs.query_lens.max()) if len(inputs.query_lens) else 1
        tiles = self.prefill_tiles if max_query * group > _MIN_ROWS else self.decode_tiles
        if tiles is PREFILL_TILES and self.head_dim > 128:
            tiles = WIDE_PREFILL_TILES
        block_m = max(tiles.rows, _MIN_ROWS, _pow2(group))
        block_q = max(1, block_m // group)
        programs = ceil_div(inputs.query_lens.astype(np.int64), block_q)
        program_seq = np.repeat(np.arange(len(programs)), programs)
        first = np.concatenate([[0], np.cumsum(programs)[:-1]]).astype(np.int64)
        program_qstart = (np.arange(len(program_seq)) - first[program_seq]) * block_q
        tree = None
        if inputs.tree_mask is not None:
            tree = torch.from_numpy(inputs.tree_mask.astype(np.int8)).to(device)
        return TritonMetadata(
            query_start=_tensor(inputs.query_start_loc, device, torch.int32),
            seq_lens=_tensor(inputs.seq_lens, device, torch.int32),
            kv_lens=_tensor(
                inputs.seq_lens if inputs.kv_lens is None else inputs.kv_lens, device, torch.int32
            ),
            block_tables=_tensor(inputs.block_tables, device, torch.int32),
            slot_mapping=_tensor(inputs.slot_mapping, device, torch.int64),
            program_seq=_tensor(program_seq, device, torch.int32),
            program_qstart=_tensor(program_qstart, device, torch.int32),
            tree_mask=tree,
            block_size=inputs.block_size,
            block_q=block_q,
            block_m=block_m,
            num_splits=self.splits(len(program_seq), int(inputs.seq_lens.max(initial=0)), device),
            tiles=tiles,
        )

    def prepare_for_capture(
        self, inputs: AttentionInputs, device: torch.device, num_splits: int = 1
    ) -> TritonMetadata:
        metadata = self.build_metadata(inputs, device)
        metadata.num_splits = num_splits
        return metadata

    def prepare_for_replay(self, metadata: TritonMetadata, inputs: AttentionInputs) -> None:
        real, q = len(inputs.query_lens), int(inputs.query_lens[0])
        tokens = real * q
        metadata.seq_lens[:real].copy_(torch.from_numpy(inputs.seq_lens.astype(np.int32)))
        metadata.seq_lens[real:].fill_(q)
        kv_lens = inputs.seq_lens if inputs.kv_lens is None else inputs.kv_lens
        metadata.kv_lens[:real].copy_(torch.from_numpy(kv_lens.astype(np.int32)))
        metadata.kv_lens[real:].fill_(q)
        # Only the columns this step reads: the table's rest is never read for these lengths
        # (and padding rows read their first block, zeroed).
        width = inputs.block_tables.shape[1]
        metadata.block_tables[:real, :width].copy_(
            torch.from_numpy(inputs.block_tables.astype(np.int32))
        )
        metadata.block_tables[real:, :1].zero_()
        metadata.slot_mapping[:tokens].copy_(torch.from_numpy(inputs.slot_mapping.astype(np.int64)))
        metadata.slot_mapping[tokens:].fill_(PAD_SLOT)

    def graph_splits(self, inputs: AttentionInputs, longest: int, device: torch.device) -> int:
        programs = self.build_metadata(inputs, torch.device("cpu")).program_seq.shape[0]
        return self.splits(programs, longest, device)

    def splits(self, programs: int, longest: int, device: torch.device) -> int:
        """Split-KV count for a step of ``programs`` query blocks whose longest sequence has
        ``longest`` KV positions: enough splits to fill the GPU's multiprocessors, 1 when the
        programs fill it already or contexts are short."""
        if self.force_splits is not None:
            return self.force_splits
        if device.type != "cuda" or longest < self.long_context:
            return 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        busy = programs * self.num_kv_heads
        if busy >= sms:
            return 1
        wanted = int(min(_MAX_SPLITS, ceil_div(sms, busy), longest // 512))
        # a power of two: NUM_SPLITS is a compile-time constant, so few distinct values
        return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache | None,
        metadata: TritonMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if kv_cache is None:
            raise RuntimeError("no KV cache bound to the model: call bind_kv_caches first")
        key_cache, value_cache = kv_cache
        write = self.write_launch(k, v, key_cache, value_cache, metadata)
        if write is not None:
            write()
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        self.attend(q, key_cache, value_cache, out, metadata, window)
        return out

    def write_launch(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TritonMetadata,
    ) -> KernelLaunch | None:
        """The KV write: token ``t``'s K/V rows into slot ``slot_mapping[t]`` (-1 skipped)."""
        tokens = k.shape[0]
        if tokens == 0:
            return None
        row = self.num_kv_heads * self.head_dim
        per_16_bytes = 16 // key_cache.element_size()
        return KernelLaunch(
            write_kv_kernel,
            (tokens,),
            (k, v, key_cache, value_cache, metadata.slot_mapping, k.stride(0), v.stride(0)),
            {"ROW": row, "ROW_POW2": _pow2(row)},
            # as many threads as 16-byte pieces of a row: each moves one at a time
            num_warps=min(8, max(1, _pow2(row) // (32 * per_16_bytes))),
            num_stages=1,
        )

    def attend(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        metadata: TritonMetadata,
        window: int | None = None,
    ) -> None:
        """The attention launch alone (K/V already in the cache)."""
        launches = self.attention_launches(q, key_cache, value_cache, out, metadata, window=window)
        for launch in launches:
            launch()

    def attention_launches(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        metadata: TritonMetadata,
        interpreted: bool = _INTERPRETED,
        window: int | None = None,
    ) -> list[KernelLaunch]:
        """The attention kernel (and the split-KV reduction) for one step, not yet launched.

        ``interpreted`` says whether the launches will run under ``TRITON_INTERPRET=1``, whose
        ``tl.dot`` needs float32 tiles.
        """
        programs = metadata.program_seq.shape[0]
        if programs == 0:
            return []
        group = self.num_heads // self.num_kv_heads
        splits = metadata.num_splits
        tiles = metadata.tiles
        group_rows = metadata.block_m >= 64
        dim_pow2 = max(16, _pow2(self.head_dim))
        parts = [out, out, out]  # unused unless split
        if splits > 1:
            shape = (programs, self.num_kv_heads, splits, metadata.block_m)
            parts = [
                torch.empty(*shape, dim_pow2, dtype=torch.float32, device=q.device),
                torch.empty(shape, dtype=torch.float32, device=q.device),
                torch.empty(shape, dtype=torch.float32, device=q.device),
            ]
        tree = metadata.tree_mask
        if tree is not None and window is not None:
            raise ValueError("tree-shaped queries cannot attend a sliding window")
        shared = {
            "NUM_KV_HEADS": self.num_kv_heads,
            "HEAD_DIM": self.head_dim,
            "HEAD_DIM_POW2": dim_pow2,
            "GROUP": group,
            "BLOCK_Q": metadata.block_q,
            "BLOCK_M": metadata.block_m,
            "NUM_SPLITS": splits,
        }
        launches = [
            KernelLaunch(
                paged_attention_kernel,
                (programs, self.num_kv_heads, splits),
                (
                    q,
                    key_cache,
                    value_cache,
                    out,
                    metadata.block_tables,
                    metadata.seq_lens,
                    metadata.kv_lens,
                    metadata.query_start,
                    metadata.program_seq,
                    metadata.program_qstart,
                    tree if tree is not None else metadata.seq_lens,
                    *parts,
                    self.scale,
                    window or 0,
                    self.softcap or 1.0,
                    q.stride(0),
                    q.stride(1),
                    out.stride(0),
                    out.stride(1),
                    metadata.block_tables.stride(0),
                    tree.stride(0) if tree is not None else 0,
                ),
                {
                    **shared,
                    "BLOCK_SIZE": metadata.block_size,
                    "BLOCK_N": tiles.block_n,
                    "HAS_TREE": tree is not None,
                    "HAS_WINDOW": window is not None,
                    "HAS_SOFTCAP": self.softcap is not None,
                    "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
                    "DOT_FP32": interpreted or q.dtype == torch.float32,
                },
                # float32 tiles take twice the registers: twice the warps keep them unspilled
                num_warps=tiles.num_warps * (2 if q.dtype == torch.float32 and group_rows else 1),
                num_stages=tiles.num_stages,
            )
        ]
        if splits > 1:
            launches.append(
                KernelLaunch(
                    reduce_splits_kernel,
                    (programs, self.num_kv_heads),
                    (
                        out,
                        *parts,
                        metadata.program_seq,
                        metadata.program_qstart,
                        metadata.query_start,
                        out.stride(0),
                        out.stride(1),
                    ),
                    shared,
                    num_warps=4,
                    num_stages=1,
                )
            )
        return launches


def _tensor(array: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)
