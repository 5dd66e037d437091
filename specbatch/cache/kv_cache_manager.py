"""Per-sequence block tables over the block pool: allocation with lookahead, rollback, prefix reuse.

The manager knows sequences only as an id, a token list, a computed-token count and a block
table; it never sees text or tensors. Invariants:

* a sequence's block table covers every slot it may write this step: its computed tokens, the
  tokens being computed, and a lookahead of draft slots;
* only blocks that are full of computed *and final* tokens are entered in the prefix index
  (``commit``), so a rejected draft can never be shared;
* every block handed out comes back through ``free`` or ``truncate``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from specbatch.cache.block_pool import BlockKey, BlockPool
from specbatch.utils import ceil_div


class CacheSequence(Protocol):
    """What the manager needs to know about a sequence."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]


@dataclass
class _HashState:
    num_committed_blocks: int = 0
    last_hash: int = 0


class KVCacheManager:
    """Block tables for sequences, drawn from one :class:`BlockPool` (the table a sequence
    keeps as ``table``: its ``block_table``, or a sliding-window group's
    ``window_table``, ``cache/window_cache.py``)."""

    table = "block_table"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_state: dict[int, _HashState] = {}
        # seq -> leading table entries it does not hold (a window group's released blocks;
        # none in a full group)
        self._unheld: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def find_cached_prefix(self, seq: CacheSequence) -> list[int]:
        """Cached blocks equal to the leading full blocks of a not-yet-started sequence.

        At least the last token is always left to compute (its logits are needed), so a prompt
        is never matched whole.
        """
        if not self.enable_prefix_caching or self.blocks(seq):
            return []
        blocks: list[int] = []
        for block in self._cached_chain(seq, (len(seq.token_ids) - 1) // self.block_size):
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(
        self,
        seq: CacheSequence,
        num_new_tokens: int,
        num_lookahead: int = 0,
        cached_prefix: list[int] | None = None,
    ) -> bool:
        """Extend ``seq``'s blocks to hold ``num_new_tokens`` more tokens plus ``num_lookahead``
        draft slots, after adopting ``cached_prefix`` (from :meth:`find_cached_prefix`).

        Returns False and changes nothing when the free blocks do not suffice, so the scheduler
        can preempt and retry.
        """
        prefix = cached_prefix or []
        if not self._extend(seq, num_new_tokens, num_lookahead, prefix):
            return False
        seq.num_computed_tokens += len(prefix) * self.block_size
        return True

    def _extend(
        self, seq: CacheSequence, num_new_tokens: int, num_lookahead: int, prefix: list[int]
    ) -> bool:
        """:meth:`allocate` but for moving the computed count past the adopted prefix."""
        if not self.can_allocate(seq, num_new_tokens, num_lookahead, prefix):
            return False
        if prefix:
            first_held = self._first_held(len(prefix))
            for block in prefix[first_held:]:
                self.pool.share(block)
            state = self._hash_state.setdefault(seq.seq_id, _HashState())
            for _ in prefix:
                state.last_hash = hash(self._key(seq, state.num_committed_blocks, state.last_hash))
                state.num_committed_blocks += 1
            if first_held:
                self._unheld[seq.seq_id] = first_held
            self.blocks(seq).extend(prefix)
        computed = seq.num_computed_tokens + len(prefix) * self.block_size
        new_blocks = self.blocks_for(computed + num_new_tokens + num_lookahead) - len(
            self.blocks(seq)
        )
        if new_blocks > 0:
            self.blocks(seq).extend(self.pool.allocate(new_blocks))
        return True

    def can_allocate(
        self,
        seq: CacheSequence,
        num_new_tokens: int,
        num_lookahead: int = 0,
        cached_prefix: list[int] | None = None,
    ) -> bool:
        """Whether :meth:`allocate` would succeed (it changes nothing)."""
        prefix = cached_prefix or []
        computed = seq.num_computed_tokens + len(prefix) * self.block_size
        needed = self.blocks_for(computed + num_new_tokens + num_lookahead)
        new_blocks = needed - len(self.blocks(seq)) - len(prefix)
        held = prefix[self._first_held(len(prefix)) :]
        revived = sum(1 for b in held if self.pool.ref_counts[b] == 0)
        return max(new_blocks, 0) + revived <= self.pool.num_free

    def commit(self, seq: CacheSequence) -> None:
        """Index the sequence's blocks that became full of computed, final tokens."""
        if not self.enable_prefix_caching:
            return
        state = self._hash_state.setdefault(seq.seq_id, _HashState())
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        while state.num_committed_blocks < full:
            index = state.num_committed_blocks
            key = self._key(seq, index, state.last_hash)
            self.pool.register(self.blocks(seq)[index], key)
            state.last_hash = hash(key)
            state.num_committed_blocks += 1

    def truncate(self, seq: CacheSequence, num_tokens: int) -> None:
        """Keep only the blocks needed for the first ``num_tokens`` slots; free the rest.

        Used after verification: slots past the accepted tokens hold rejected drafts. Committed
        (indexed) blocks are never affected since they hold only accepted tokens.
        """
        state = self._hash_state.get(seq.seq_id)
        keep = max(self.blocks_for(num_tokens), state.num_committed_blocks if state else 0)
        keep = max(keep, self.unheld(seq))
        if keep < len(self.blocks(seq)):
            tail = self.blocks(seq)[keep:]
            del self.blocks(seq)[keep:]
            self.pool.release(tail[::-1])

    def free(self, seq: CacheSequence) -> None:
        """Return all of a finished, aborted or preempted sequence's blocks."""
        # Reverse order: the tail (least shareable) blocks are evicted first.
        self.pool.release(self.blocks(seq)[self.unheld(seq) :][::-1])
        self.blocks(seq).clear()
        self._hash_state.pop(seq.seq_id, None)
        self._unheld.pop(seq.seq_id, None)

    def unheld(self, seq: CacheSequence) -> int:
        """The leading entries of the sequence's table it no longer holds."""
        return self._unheld.get(seq.seq_id, 0)

    def _first_held(self, num_blocks: int) -> int:
        """The first entry of a cached prefix of ``num_blocks`` blocks the sequence will hold
        (a full group: all)."""
        return 0

    def blocks(self, seq: CacheSequence) -> list[int]:
        """The sequence's table of this manager's blocks."""
        table: list[int] = getattr(seq, self.table)
        return table

    def _cached_chain(self, seq: CacheSequence, num_blocks: int) -> Iterator[int | None]:
        """The cached block (or None) for each of the sequence's first ``num_blocks`` full
        blocks, looked up by their chained keys."""
        parent = 0
        for index in range(num_blocks):
            key = self._key(seq, index, parent)
            yield self.pool.lookup(key)
            parent = hash(key)

    def _key(self, seq: CacheSequence, block_index: int, parent: int) -> BlockKey:
        start = block_index * self.block_size
        return (parent, tuple(seq.token_ids[start : start + self.block_size]))
