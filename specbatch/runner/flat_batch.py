"""Flattening a step's per-sequence token runs into one ragged batch (host arrays).

A run's drafts may form a tree (``draft_parents``): each node is computed at the rotary
position of its depth, written at the cache slot of its index in the run (so siblings do not
overwrite each other), and attends to the sequence's cache and to its ancestors only (the
step's tree mask). After verification the accepted path's K/V move to the sequence's
contiguous positions (:func:`specbatch.cache.kv_tensors.move_slots`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specbatch.kernels.attention import PAD_SLOT, AttentionInputs
from specbatch.utils import ceil_div


@dataclass
class TokenRun:
    """Consecutive tokens of one sequence, the first at ``start_position``, to compute now."""

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    # Trailing draft tokens among ``token_ids`` (a decode verifying them: 1 + num_drafts).
    num_drafts: int = 0
    # Trailing filler tokens that get no cache slot (PAD_SLOT): computed only so that a step
    # keeps the uniform shape of a CUDA graph; nothing reads their K/V or their outputs.
    num_unslotted: int = 0
    # The drafts as a tree: draft i follows draft ``draft_parents[i]`` (an earlier one), or
    # the run's first token for -1. None: a chain.
    draft_parents: Sequence[int] | None = None
    # The sliding layers' blocks where they have their own cache group (cache/window_cache.py)
    window_table: Sequence[int] | None = None

    def __post_init__(self) -> None:
        parents = self.draft_parents
        if parents is None:
            return
        if len(parents) != self.num_drafts or not self.is_decode:
            raise ValueError("a draft tree needs one token, its drafts and a parent per draft")
        if any(not -1 <= parent < i for i, parent in enumerate(parents)):
            raise ValueError("a draft's parent must be -1 or an earlier draft")

    def offsets(self) -> np.ndarray:
        """Each token's position past ``start_position``: its index, or its depth in a tree
        (fillers after a tree: their index)."""
        offsets = np.arange(len(self.token_ids))
        for i, parent in enumerate(self.draft_parents or ()):
            offsets[1 + i] = offsets[parent + 1] + 1
        return offsets

    def tree_mask(self, width: int) -> np.ndarray:
        """``[len(token_ids), width]``: which of the run's tokens each one attends to."""
        count = len(self.token_ids)
        mask = np.zeros((count, width), dtype=bool)
        mask[:, :count] = np.tri(count, dtype=bool)  # causal (fillers too: nothing reads them)
        if self.draft_parents is not None:
            nodes = 1 + len(self.draft_parents)
            mask[:nodes, :nodes] = False
            for row in range(nodes):  # itself and its ancestors (draft i is token 1 + i)
                token = row
                while token > 0:
                    mask[row, token] = True
                    token = self.draft_parents[token - 1] + 1
                mask[row, 0] = True
        return mask

    @property
    def is_decode(self) -> bool:
        """One new token, plus drafts to verify."""
        return len(self.token_ids) - self.num_drafts - self.num_unslotted == 1

    def with_fillers(self, num_drafts: int) -> TokenRun:
        """The run padded to ``num_drafts`` drafts with fillers (which come after every real
        token, so no real row attends to them, and are never verified)."""
        fillers = num_drafts - self.num_drafts - self.num_unslotted
        if fillers <= 0:
            return self
        return TokenRun(
            [*self.token_ids, *[self.token_ids[-1]] * fillers],
            self.start_position,
            self.block_table,
            self.num_drafts,
            self.num_unslotted + fillers,
            self.draft_parents,
            self.window_table,
        )


@dataclass
class LogitRows:
    """Which rows of a step need logits: ``offset`` within run ``run``, in the order wanted."""

    run: np.ndarray  # [R] int
    offset: np.ndarray  # [R] int

    def flat(self, query_start: np.ndarray) -> np.ndarray:
        return query_start[self.run] + self.offset


@dataclass
class FlatBatch:
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    attention: AttentionInputs
    query_start: np.ndarray  # [B + 1]: run b owns flat rows query_start[b]:query_start[b + 1]
    # the sliding layers' layout where they have their own cache group (its block tables and
    # slots; the same queries)
    window_attention: AttentionInputs | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def cache_slots(
    block_table: np.ndarray, positions: np.ndarray, block_size: int, rows: np.ndarray | None = None
) -> np.ndarray:
    """The cache slot (``block * block_size + offset``) of each position: through one block
    table, or with ``rows`` through row ``rows[i]`` of a 2-D table for position ``i``."""
    index = positions // block_size
    blocks = block_table[index] if rows is None else block_table[rows, index]
    return blocks * block_size + positions % block_size


def flatten(runs: Sequence[TokenRun], block_size: int) -> FlatBatch:
    """Positions and cache slots of every token, computed for the whole batch at once."""
    query_lens = np.fromiter((len(r.token_ids) for r in runs), dtype=np.int64, count=len(runs))
    starts = np.fromiter((r.start_position for r in runs), dtype=np.int64, count=len(runs))
    query_start = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    total = int(query_start[-1])

    # Wide enough for every position the step attends to (fillers may lie past the blocks
    # a sequence holds: their table entries read block 0, never past the table).
    ends = ceil_div(starts + query_lens, block_size)
    width = max(max((len(r.block_table) for r in runs), default=1), int(ends.max(initial=1)), 1)
    block_tables = _tables([r.block_table for r in runs], width)

    run_of_token = np.repeat(np.arange(len(runs)), query_lens)
    offsets = np.arange(total) - query_start[:-1][run_of_token]  # index in the run: the slot
    positions = starts[run_of_token] + offsets
    trees = [b for b, r in enumerate(runs) if r.draft_parents is not None]
    tree_mask = None
    if trees:  # the rotary position is the depth; every run gets its row of the mask
        width = int(query_lens.max())
        tree_mask = np.concatenate([r.tree_mask(width) for r in runs])
        for b in trees:
            rows = slice(int(query_start[b]), int(query_start[b + 1]))
            positions[rows] = starts[b] + runs[b].offsets()
    slot_positions = starts[run_of_token] + offsets
    unslotted = np.fromiter((r.num_unslotted for r in runs), dtype=np.int64, count=len(runs))
    filler = offsets >= (query_lens - unslotted)[run_of_token]

    def layout(tables: np.ndarray, held: list[int]) -> AttentionInputs:
        slots = cache_slots(tables, slot_positions, block_size, rows=run_of_token)
        if np.any(~filler & (slot_positions // block_size >= np.array(held)[run_of_token])):
            raise ValueError("a token to compute lies past its sequence's blocks")
        slots[filler] = PAD_SLOT
        return AttentionInputs(
            query_lens=query_lens,
            seq_lens=starts + query_lens,
            block_tables=tables,
            slot_mapping=slots,
            block_size=block_size,
            tree_mask=tree_mask,
            kv_lens=starts + query_lens - unslotted if unslotted.any() else None,
        )

    input_ids = np.fromiter((t for r in runs for t in r.token_ids), dtype=np.int64, count=total)
    attention = layout(block_tables, [len(r.block_table) for r in runs])
    window = None
    if runs and runs[0].window_table is not None:
        window_tables = [r.window_table or () for r in runs]
        window = layout(_tables(window_tables, width), [len(t) for t in window_tables])
    return FlatBatch(input_ids, positions, attention, query_start, window)


def _tables(tables: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """The runs' block tables as rows of ``width`` (padded with block 0)."""
    out = np.zeros((len(tables), width), dtype=np.int64)
    for b, table in enumerate(tables):
        out[b, : len(table)] = table
    return out
