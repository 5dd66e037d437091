"""The attention-backend interface: build metadata for a step, then attend layer by layer.

A step is a flat ragged batch. Sequence ``b`` contributes ``query_lens[b]`` consecutive query
tokens (a prefill chunk, a single decode token, or ``[last_token, d1..dk]`` to verify k drafts)
that sit at the end of its ``seq_lens[b]`` key/value positions: query ``i`` of sequence ``b`` is at
position ``seq_lens[b] - query_lens[b] + i`` and may attend positions up to and including its own.
Its K/V are written into the paged cache at ``slot_mapping`` (``-1``: do not write) before
attending, so the cached and the new tokens are read the same way, through the block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Per layer: (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
LayerKVCache = tuple[torch.Tensor, torch.Tensor]

PAD_SLOT = -1
"""The one sentinel of the cache layout: a slot-mapping entry that writes nothing."""


@dataclass
class AttentionInputs:
    """Backend-independent description of one forward's attention layout (host arrays).

    ``tree_mask``, when given, replaces the causal rule *among the query tokens of a sequence*:
    for flat query token ``t`` and query index ``j`` of the same sequence, ``tree_mask[t, j]``
    says whether ``t`` may attend the ``j``-th new token of its sequence (cached positions are
    always visible). It exists for tree-shaped speculation; ``None`` means a causal chain.
    """

    query_lens: np.ndarray  # [B] int
    seq_lens: np.ndarray  # [B] int, K/V length after this step's writes
    block_tables: np.ndarray  # [B, max_blocks] int, rows padded with 0 past the sequence
    slot_mapping: np.ndarray  # [T] int, PAD_SLOT = skip
    block_size: int
    tree_mask: np.ndarray | None = None  # [T, max_query_len] bool
    # [B] positions that hold K/V after this step: seq_lens less trailing filler tokens (no
    # slot; computed only to keep a CUDA graph's shape). None: seq_lens. Backends that honour
    # it neither read filler positions nor compute filler rows; the others compute them.
    kv_lens: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.query_lens) != len(self.seq_lens) or len(self.query_lens) != len(
            self.block_tables
        ):
            raise ValueError("query_lens, seq_lens and block_tables must have one row per sequence")
        if int(np.sum(self.query_lens)) != len(self.slot_mapping):
            raise ValueError("slot_mapping must have one entry per query token")
        if np.any(self.query_lens > self.seq_lens):
            raise ValueError("a sequence cannot have more query tokens than key/value positions")
        if self.kv_lens is not None and np.any(
            (self.kv_lens > self.seq_lens) | (self.kv_lens <= self.seq_lens - self.query_lens)
        ):
            raise ValueError("kv_lens must keep at least one query token and not exceed seq_lens")

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    @property
    def query_start_loc(self) -> np.ndarray:
        """Cumulative query lengths, ``[B + 1]``: sequence ``b`` owns rows ``[s[b], s[b+1])``."""
        return np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int64)


@dataclass
class GroupedMetadata:
    """A step's metadata where the sliding-window layers have their own cache group
    (``cache/window_cache.py``): ``full`` for the other layers, ``window`` for them (the same
    queries through their own block tables and slots)."""

    full: Any
    window: Any

    def for_layer(self, window: int | None) -> Any:
        return self.full if window is None else self.window


class AttentionBackend(ABC):
    """Stateless paged attention for one model shape (head counts, head size).

    Backends that can run inside a CUDA graph set ``supports_cuda_graphs`` and implement the
    capture/replay hooks: the graph runner captures a forward over the metadata of
    :meth:`prepare_for_capture` (a padded shape), and before each replay
    :meth:`prepare_for_replay` copies the step's layout into those same tensors.
    """

    name: str = "abstract"
    supports_cuda_graphs: bool = False
    # Contexts from which a graph with split-KV (flash decoding) replays, for backends that
    # split; never, for the others.
    long_context: int = 1 << 62

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # scores become softcap tanh(score / softcap) before the softmax (Gemma 2); None: not
        self.softcap: float | None = None

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> Any:
        """Turn the step's layout into whatever tensors ``forward`` needs, once per step."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache | None,
        metadata: Any,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` at the slot mapping, attend ``q`` through the block tables.

        ``q`` is ``[T, num_heads, head_dim]``, ``k`` and ``v`` ``[T, num_kv_heads, head_dim]``
        (views may be strided); returns ``[T, num_heads, head_dim]``. With ``window`` (a
        sliding layer's) a query at position p sees positions p - window + 1 .. p only.
        """

    def prepare_for_capture(
        self, inputs: AttentionInputs, device: torch.device, num_splits: int = 1
    ) -> Any:
        """Metadata for a graph of the padded layout ``inputs``, whose tensors the graph keeps
        reading on every replay; ``num_splits`` is the split-KV count compiled into it."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def prepare_for_replay(self, metadata: Any, inputs: AttentionInputs) -> None:
        """Copy a step's layout (at most the captured batch, the same query length) into the
        tensors of captured ``metadata``; the rows past the step's become inert padding."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def graph_splits(self, inputs: AttentionInputs, longest: int, device: torch.device) -> int:
        """The split-KV count a graph of the padded layout ``inputs`` should be captured with
        for contexts up to ``longest`` positions (1: no split-KV graph)."""
        return 1
