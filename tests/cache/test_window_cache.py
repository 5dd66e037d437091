"""The sliding-window layers' own cache group: blocks released once past every window, both
groups allocated together or not at all, prefix hits cut to where the window is cached, and
every block back in its pool after any mix of allocations, commits, rollbacks and frees (a
random walk against the rule written out)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from specbatch.cache.kv_cache_manager import KVCacheManager
from specbatch.cache.window_cache import HybridKVCache, WindowCacheManager
from specbatch.utils import ceil_div


@dataclass
class FakeSeq:
    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    window_table: list[int] = field(default_factory=list)


def hybrid(
    full: int = 32, window_blocks: int = 16, window: int = 6, prefix: bool = True
) -> HybridKVCache:
    return HybridKVCache(
        KVCacheManager(full, 4, prefix), WindowCacheManager(window_blocks, 4, prefix, window)
    )


def test_blocks_past_every_window_go_back() -> None:
    cache = hybrid(window=6)
    seq = FakeSeq(0, list(range(30)))
    assert cache.allocate(seq, 30)
    assert len(seq.block_table) == len(seq.window_table) == 8
    seq.num_computed_tokens = 30
    cache.commit(seq)
    # the next token (position 30) sees 25 .. 30: blocks 0 .. 5 (positions 0 .. 23) are dead
    assert cache.window.unheld(seq) == 6
    assert cache.window.num_free_blocks == 16 - 2
    assert cache.full.num_free_blocks == 32 - 8  # the full layers keep everything
    cache.truncate(seq, 31)  # a rollback never takes back a released block
    cache.free(seq)
    assert cache.window.num_free_blocks == 16
    assert cache.full.num_free_blocks == 32
    cache.window.pool.check_consistency()


def test_an_allocation_is_from_both_groups_or_neither() -> None:
    cache = hybrid(full=32, window_blocks=3, window=6)
    seq = FakeSeq(0, list(range(16)))
    assert not cache.allocate(seq, 16)  # the window group lacks the room
    assert seq.block_table == seq.window_table == []
    assert cache.full.num_free_blocks == 32
    assert cache.allocate(seq, 12)
    assert cache.full.num_free_blocks == 29
    assert cache.window.num_free_blocks == 0


def test_a_prefix_hit_reaches_as_far_as_its_window_is_cached() -> None:
    cache = hybrid(window=6)
    first = FakeSeq(0, list(range(21)))
    assert cache.allocate(first, 21)
    first.num_computed_tokens = 21
    cache.commit(first)  # blocks 0 .. 4 full and indexed; window blocks 0 .. 3 released
    second = FakeSeq(1, [*range(20), 99, 100])
    prefix = cache.find_cached_prefix(second)
    assert len(prefix) == 5  # 20 positions: the resume point's window (15 .. 20) is cached
    assert cache.allocate(second, len(second.token_ids) - 20, 0, prefix)
    assert second.num_computed_tokens == 20
    assert second.block_table[:5] == first.block_table[:5]
    assert second.window_table[3:5] == first.window_table[3:5]  # shared: the window's
    assert cache.window.unheld(second) == 3  # entries 0 .. 2 lie before it, not held
    for seq in (first, second):
        cache.free(seq)
    assert cache.window.num_free_blocks == 16
    cache.window.pool.check_consistency()
    third = FakeSeq(2, list(range(21)))  # the released window blocks were taken back over
    for _ in range(3):  # by other sequences: a hit stops where its window is gone
        other = FakeSeq(9, [1000 + i for i in range(60)])
        assert cache.allocate(other, 60)
        cache.free(other)
    assert len(cache.find_cached_prefix(third)) < 5


def holders(cache: HybridKVCache, seqs: list[FakeSeq]) -> tuple[Counter[int], Counter[int]]:
    full: Counter[int] = Counter()
    window: Counter[int] = Counter()
    for seq in seqs:
        full.update(seq.block_table)
        window.update(seq.window_table[cache.window.unheld(seq) :])
    return full, window


@pytest.mark.parametrize("seed", range(6))
def test_a_random_walk_keeps_every_count(seed: int) -> None:
    """Admissions with prefix hits, prefill chunks, decodes with drafts, partial acceptance
    (rollback), finishes and preemptions: each block's references equal its holders, the
    window group holds no block before any sequence's window, and all come back."""
    rng = random.Random(seed)
    window, block = 7, 4
    cache = HybridKVCache(
        KVCacheManager(40, block, True), WindowCacheManager(24, block, True, window)
    )
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(3, 30))] for _ in range(4)]
    running: list[FakeSeq] = []
    for step in range(300):
        if len(running) < 3 and rng.random() < 0.4:
            seq = FakeSeq(step, list(rng.choice(prompts)))
            prefix = cache.find_cached_prefix(seq)
            new = len(seq.token_ids) - len(prefix) * block
            chunk = min(new, rng.randrange(1, 12))
            if cache.allocate(seq, chunk, 0, prefix):
                seq.num_computed_tokens += chunk  # (the prefix is already counted)
                cache.commit(seq)
                running.append(seq)
        for seq in list(running):
            if rng.random() < 0.1:  # finished or preempted
                running.remove(seq)
                cache.free(seq)
                continue
            todo = len(seq.token_ids) - seq.num_computed_tokens
            drafts = rng.randrange(4) if todo <= 1 else 0
            new = max(1, min(todo, rng.randrange(1, 10)))
            if todo <= 0:
                seq.token_ids.append(rng.randrange(5))
                new = 1
            if not cache.allocate(seq, new, drafts):
                running.remove(seq)
                cache.free(seq)
                continue
            accepted = rng.randrange(drafts + 1)
            seq.token_ids += [rng.randrange(5) for _ in range(accepted)]
            seq.num_computed_tokens += new + accepted
            cache.commit(seq)
            cache.truncate(seq, len(seq.token_ids) + rng.randrange(3))
        full, held = holders(cache, running)
        for pool, counts in ((cache.full.pool, full), (cache.window.pool, held)):
            pool.check_consistency()
            assert all(pool.ref_counts[b] == counts[b] for b in range(pool.num_blocks))
        for seq in running:  # nothing held before the next token's window
            first = max(0, seq.num_computed_tokens - window + 1) // block
            assert cache.window.unheld(seq) >= first
            assert len(seq.window_table) == len(seq.block_table)
            assert (
                len(seq.window_table) - cache.window.unheld(seq) <= ceil_div(window + 30, block) + 2
            )
    for seq in running:
        cache.free(seq)
    assert cache.full.num_free_blocks == 40
    assert cache.window.num_free_blocks == 24
