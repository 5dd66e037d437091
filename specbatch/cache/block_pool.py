"""The pool of KV-cache blocks: reference counts, an LRU free list, and the prefix-cache index.

A block whose reference count drops to zero goes to the tail of the free list but keeps its
contents and, if it was a cached full block, its entry in the prefix index. It is only evicted
(forgotten by the index) when the head of the free list is handed out again: freed prefixes stay
reusable for as long as memory allows ("lazy eviction").
"""

from __future__ import annotations

from collections import OrderedDict

# A full block's identity: the hash of its parent block's key and its own tokens. Keeping the
# tokens inside the key makes every index hit an exact comparison, not a hash-equality bet.
BlockKey = tuple[int, tuple[int, ...]]


class BlockPool:
    """Hands out block ids, counts their users, and indexes cached full blocks by content."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._index: dict[BlockKey, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (unreferenced, cached or not)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the head of the free list (evicting their cache entries)."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; unreferenced blocks join the free list's tail."""
        for block in blocks:
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            self.ref_counts[block] = count
            if count == 0:
                self._free[block] = None

    def lookup(self, key: BlockKey) -> int | None:
        """The cached block holding exactly ``key``'s content, if it is still in memory."""
        return self._index.get(key)

    def share(self, block: int) -> None:
        """Take one more reference to a cached block (a prefix-cache hit)."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def register(self, block: int, key: BlockKey) -> None:
        """Record that ``block`` (full, computed, final) holds ``key``'s content."""
        if self._key_of[block] is not None or key in self._index:
            return  # already indexed, or another block holds the same content
        self._key_of[block] = key
        self._index[key] = block

    def _evict(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            self._key_of[block] = None
            del self._index[key]

    def check_consistency(self) -> None:
        """Raise if the free list, reference counts and index disagree (for tests)."""
        for block in range(self.num_blocks):
            in_free = block in self._free
            if in_free != (self.ref_counts[block] == 0):
                raise AssertionError(
                    f"block {block}: free={in_free}, refs={self.ref_counts[block]}"
                )
        for key, block in self._index.items():
            if self._key_of[block] != key:
                raise AssertionError(f"index entry for block {block} does not match its key")
