"""KV cache manager: lookahead allocation, rollback, prefix reuse of final blocks only."""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.cache.kv_cache_manager import KVCacheManager


@dataclass
class FakeSeq:
    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)


def test_allocate_with_lookahead_covers_draft_slots() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    seq = FakeSeq(0, list(range(6)))
    assert kv.allocate(seq, num_new_tokens=6)
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 6
    seq.token_ids.append(99)
    # decode of token 7 (position 6) with 3 draft slots: positions 6..9 -> 3 blocks
    assert kv.allocate(seq, num_new_tokens=1, num_lookahead=3)
    assert seq.block_table == [0, 1, 2]
    assert kv.num_free_blocks == 7


def test_allocation_refusal_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    seq = FakeSeq(0, list(range(10)))
    assert kv.allocate(seq, 10)
    other = FakeSeq(1, list(range(5)))
    assert not kv.allocate(other, 5)
    assert other.block_table == []
    assert kv.num_free_blocks == 0


def test_truncate_returns_blocks_past_the_valid_end() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = FakeSeq(0, list(range(9)))
    assert kv.allocate(seq, 9, num_lookahead=6)  # 15 slots -> 4 blocks
    assert seq.block_table == [0, 1, 2, 3]
    kv.truncate(seq, 10)  # 10 valid tokens -> 3 blocks
    assert seq.block_table == [0, 1, 2]
    assert kv.num_free_blocks == 5
    kv.free(seq)
    assert kv.num_free_blocks == 8
    kv.pool.check_consistency()


def test_prefix_hit_shares_full_committed_blocks_only() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = FakeSeq(0, list(range(10)))
    assert kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.commit(first)  # blocks 0, 1 are full; block 2 (2 tokens) is not indexed
    second = FakeSeq(1, list(range(9)) + [777, 778])
    prefix = kv.find_cached_prefix(second)
    assert prefix == first.block_table[:2]
    assert kv.allocate(second, 11 - 8, cached_prefix=prefix)
    assert second.num_computed_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert kv.pool.ref_counts[first.block_table[0]] == 2


def test_prompt_is_never_matched_whole() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = FakeSeq(0, list(range(8)))
    assert kv.allocate(first, 8)
    first.num_computed_tokens = 8
    kv.commit(first)
    same = FakeSeq(1, list(range(8)))
    assert kv.find_cached_prefix(same) == first.block_table[:1]  # the last token stays to compute


def test_uncomputed_or_rejected_tokens_are_not_committed() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    seq = FakeSeq(0, list(range(3)))
    assert kv.allocate(seq, 3, num_lookahead=5)  # drafts would fill the first two blocks
    seq.num_computed_tokens = 3  # ...but only 3 tokens are accepted
    kv.commit(seq)
    assert kv.pool.num_cached == 0
    probe = FakeSeq(1, [0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.find_cached_prefix(probe) == []


def test_freed_prefix_is_reused_after_finish() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first = FakeSeq(0, [5, 6, 7, 8, 9])
    assert kv.allocate(first, 5)
    first.num_computed_tokens = 5
    kv.commit(first)
    kv.free(first)
    assert kv.num_free_blocks == 4
    again = FakeSeq(1, [5, 6, 7, 8, 1, 2])
    prefix = kv.find_cached_prefix(again)
    assert len(prefix) == 2
    assert kv.allocate(again, 2, cached_prefix=prefix)
    assert again.num_computed_tokens == 4
    kv.pool.check_consistency()
