"""The cache of a model with sliding-window layers: their K/V kept only for their window.

A sliding layer's query at position p reads positions p - window + 1 .. p. Those layers get
their own K/V tensors and their own block pool: each sequence holds a ``window_table`` beside
its ``block_table``, entry j for positions j * block_size onwards, and once every future query
starts past a block's last position (after a step, the next token's window begins at
``num_computed_tokens - window + 1``) the block goes back to the pool. Its entry stays in the
table, pointing at a block the sequence no longer holds: attention never reads those positions
(the CPU kernel skips blocks before a row's window, the Triton kernel masks them) or reads them
masked (the reference gathers every position; whatever another sequence wrote there is finite).

Full blocks are entered in the window pool's prefix index as in the full pool (same keys), and
a released one keeps its entry until its memory is reused, so a prefix hit still finds the
window it needs: a hit of m full-pool blocks is taken only as far as the window blocks before
its resume point are cached too (the earlier entries of the new sequence's window table point
at block 0 and are never read). :class:`HybridKVCache` puts the two groups behind the one
manager interface the scheduler knows: every allocation is taken from both or from neither.
"""

from __future__ import annotations

from specbatch.cache.block_pool import BlockPool
from specbatch.cache.kv_cache_manager import CacheSequence, KVCacheManager

_UNHELD = 0  # what a window-table entry the sequence does not hold points at


class WindowCacheManager(KVCacheManager):
    """Window tables over the sliding layers' pool: the blocks a sequence's windows can still
    read."""

    table = "window_table"

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, window: int
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window

    def release_outside(self, seq: CacheSequence) -> None:
        """Give back the blocks before the next token's window."""
        first_needed = max(0, seq.num_computed_tokens - self.window + 1)
        table, start = self.blocks(seq), self.unheld(seq)
        dead = min(first_needed // self.block_size, len(table))
        if dead > start:
            self.pool.release(table[start:dead])
            self._unheld[seq.seq_id] = dead

    def window_prefix(self, seq: CacheSequence, num_blocks: int) -> list[int]:
        """The longest leading run, at most ``num_blocks`` blocks, whose resume point's window
        is cached in this pool: the table's entries up to there (``_UNHELD`` before the
        window)."""
        if not self.enable_prefix_caching or self.blocks(seq) or num_blocks == 0:
            return []
        found = list(self._cached_chain(seq, num_blocks))
        for count in range(num_blocks, 0, -1):
            lowest = self._first_held(count)
            if all(block is not None for block in found[lowest:count]):
                return [_UNHELD if i < lowest else found[i] for i in range(count)]  # type: ignore[misc]
        return []

    def allocate(
        self,
        seq: CacheSequence,
        num_new_tokens: int,
        num_lookahead: int = 0,
        cached_prefix: list[int] | None = None,
    ) -> bool:
        """As the full group's, adopting a window prefix (:meth:`window_prefix`) without moving
        the computed count: :class:`HybridKVCache` lets the full group move it."""
        return self._extend(seq, num_new_tokens, num_lookahead, cached_prefix or [])

    def _first_held(self, num_blocks: int) -> int:
        """The first entry of a window prefix of ``num_blocks`` blocks the sequence holds: the
        block of the resume point's window's first position (before it: ``_UNHELD``)."""
        return max(0, num_blocks * self.block_size - self.window + 1) // self.block_size


class HybridKVCache:
    """The full-attention layers' manager and the sliding layers' behind one interface:
    allocations from both or neither, commits, rollbacks and frees applied to both, blocks
    past every window released after each commit."""

    def __init__(self, full: KVCacheManager, window: WindowCacheManager) -> None:
        if full.block_size != window.block_size:
            raise ValueError("both groups must use one block size")
        self.full, self.window = full, window
        self.block_size = full.block_size
        self.enable_prefix_caching = full.enable_prefix_caching
        self._window_prefixes: dict[int, list[int]] = {}  # seq -> its pending window hit

    @property
    def pool(self) -> BlockPool:
        """The full group's pool (the window group's: ``window.pool``)."""
        return self.full.pool

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """The full group's free blocks (the window group's: ``window.num_free_blocks``)."""
        return self.full.num_free_blocks

    @property
    def usage(self) -> float:
        """The fuller group's share of its blocks in use."""
        return max(self.full.usage, self.window.usage)

    def blocks_for(self, num_tokens: int) -> int:
        return self.full.blocks_for(num_tokens)

    def find_cached_prefix(self, seq: CacheSequence) -> list[int]:
        """The full pool's hit, cut to where the window pool holds the window before it."""
        full = self.full.find_cached_prefix(seq)
        window = self.window.window_prefix(seq, len(full))
        self._window_prefixes[seq.seq_id] = window
        return full[: len(window)]

    def allocate(
        self,
        seq: CacheSequence,
        num_new_tokens: int,
        num_lookahead: int = 0,
        cached_prefix: list[int] | None = None,
    ) -> bool:
        prefix = cached_prefix or []
        window = self._window_prefixes.pop(seq.seq_id, []) if prefix else []
        if len(window) != len(prefix):
            raise ValueError("a cached prefix must come from find_cached_prefix")
        if not (
            self.full.can_allocate(seq, num_new_tokens, num_lookahead, prefix)
            and self.window.can_allocate(seq, num_new_tokens, num_lookahead, window)
        ):
            return False
        # the window group first: the full group's adoption of the prefix moves the computed count
        self.window.allocate(seq, num_new_tokens, num_lookahead, window)
        self.full.allocate(seq, num_new_tokens, num_lookahead, prefix)
        return True

    def commit(self, seq: CacheSequence) -> None:
        self.full.commit(seq)
        self.window.commit(seq)
        self.window.release_outside(seq)

    def truncate(self, seq: CacheSequence, num_tokens: int) -> None:
        self.full.truncate(seq, num_tokens)
        self.window.truncate(seq, num_tokens)

    def free(self, seq: CacheSequence) -> None:
        self.full.free(seq)
        self.window.free(seq)
        self._window_prefixes.pop(seq.seq_id, None)
