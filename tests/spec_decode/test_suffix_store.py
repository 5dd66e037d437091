"""The store of other requests' tokens against a slow, obvious reference: a list of whole
documents, scanned in full for every lookup."""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest

from specbatch.spec_decode.proposers.ngram import heaviest_chain
from specbatch.spec_decode.proposers.suffix import SuffixHit, SuffixStore


class SlowStore:
    """The documents held, oldest first: the newest whose sizes (a separator each) fit."""

    def __init__(self, capacity: int, key: int, max_match: int, occurrences: int) -> None:
        self.capacity, self.key, self.max_match = capacity, key, max_match
        self.occurrences = occurrences
        self.docs: list[list[int]] = []

    def insert(self, tokens: list[int]) -> None:
        tokens = tokens[-(self.capacity - 1) :]
        if len(tokens) <= self.key:
            return
        self.docs.append(tokens)
        while sum(len(d) + 1 for d in self.docs) > self.capacity:
            self.docs.pop(0)

    def lookup(self, context: list[int], depth: int) -> SuffixHit:
        key = self.key
        if len(context) < key or depth < 1:
            return SuffixHit(0, [])
        found = [
            (doc, end)
            for doc in self.docs
            for end in range(key, len(doc))
            if doc[end - key : end] == context[-key:]
        ]
        found = found[-self.occurrences :][::-1]  # the latest, latest first
        if not found:
            return SuffixHit(0, [])

        def matched(doc: list[int], end: int) -> int:
            n, most = 0, min(self.max_match, len(context), end)
            while n < most and doc[end - 1 - n] == context[-1 - n]:
                n += 1
            return n

        lengths = [matched(doc, end) for doc, end in found]
        longest = max(lengths)
        chosen = [f for f, n in zip(found, lengths, strict=True) if n == longest]
        return SuffixHit(longest, [doc[end : end + depth] for doc, end in chosen])


@pytest.mark.parametrize("seed", range(6))
def test_the_store_answers_as_the_reference_through_inserts_and_evictions(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(3, 12))  # small: long matches and repeated keys
    capacity = int(rng.integers(40, 400))
    key, max_match, occurrences = int(rng.integers(1, 4)), int(rng.integers(3, 9)), 6
    store = SuffixStore(capacity, key, max_match, occurrences)
    slow = SlowStore(capacity, key, max_match, occurrences)
    phrase = rng.integers(0, vocab, 12).tolist()
    for _ in range(120):
        length = int(rng.integers(0, capacity // 2))
        doc = rng.integers(0, vocab, length).tolist()
        if rng.random() < 0.5:  # a shared phrase: matches across documents
            at = int(rng.integers(0, max(length, 1)))
            doc[at:at] = phrase
        store.insert(doc)
        slow.insert(doc)
        for _ in range(4):
            context = rng.integers(0, vocab, int(rng.integers(0, 14))).tolist()
            if rng.random() < 0.5:
                context += phrase[: int(rng.integers(1, len(phrase)))]
            depth = int(rng.integers(0, 7))
            assert store.lookup(context, depth) == slow.lookup(context, depth)
        stats = store.stats()
        assert stats.documents == len(slow.docs)
        assert stats.tokens == sum(len(d) + 1 for d in slow.docs) <= capacity
        assert store.keys() <= stats.tokens


def test_a_document_longer_than_the_store_keeps_its_end() -> None:
    store = SuffixStore(16, key_length=2)
    store.insert(list(range(100)))
    assert store.stats().tokens == 16
    assert store.lookup([96, 97], 5) == SuffixHit(2, [[98, 99]])
    assert store.lookup([80, 81], 5) == SuffixHit(0, [])


def trie_heaviest_path(continuations: list[list[int]]) -> list[int]:
    """The heaviest path read off the whole trie, built node by node: per path, how many
    continuations pass through it; from the root, the child with the most (the first made
    on a tie: the latest continuation's)."""
    counts: dict[tuple[int, ...], int] = {}  # a path -> continuations through it, in order made
    for continuation in continuations:
        for depth in range(1, len(continuation) + 1):
            path = tuple(continuation[:depth])
            counts[path] = counts.get(path, 0) + 1
    path: tuple[int, ...] = ()
    while True:
        children = [p for p in counts if len(p) == len(path) + 1 and p[: len(path)] == path]
        if not children:
            return list(path)
        path = max(children, key=counts.__getitem__)


@pytest.mark.parametrize("seed", range(20))
def test_heaviest_chain_is_the_tries_heaviest_path(seed: int) -> None:
    rng = np.random.default_rng(seed)
    continuations = [
        rng.integers(0, 3, int(rng.integers(0, 6))).tolist() for _ in range(rng.integers(1, 9))
    ]
    assert heaviest_chain(continuations) == trie_heaviest_path(continuations)


def test_heaviest_chain_follows_the_majority_then_the_latest() -> None:
    assert heaviest_chain([[1, 2, 3], [1, 5], [1, 5, 6], [4]]) == [1, 5, 6]
    assert heaviest_chain([[7, 8], [9, 8]]) == [7, 8]  # a tie: the latest's
    assert heaviest_chain([[], []]) == []


def test_concurrent_lookups_never_see_a_half_written_document() -> None:
    """Writers insert documents ``[1, 2] + [w] * 40`` (overwriting the oldest: the store holds
    about two); readers look ``[1, 2]`` up. A half-written document, or one half overwritten,
    would continue with a mixture of tokens or stop short."""
    store = SuffixStore(100, key_length=2, occurrences=4)
    stop = threading.Event()
    seen: list[list[int]] = []
    errors: list[str] = []

    def write(first: int) -> None:
        token = first
        while not stop.is_set():
            store.insert([1, 2] + [token] * 40)
            token += 2

    def read() -> None:
        while not stop.is_set():
            for row in store.lookup([1, 2], 40).continuations:
                seen.append(row)
                if len(row) != 40 or len(set(row)) != 1:
                    errors.append(str(row))

    threads = [threading.Thread(target=write, args=(10 + w,)) for w in range(2)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    stop.wait(1.5)
    stop.set()
    for thread in threads:
        thread.join()
    assert len(seen) > 100
    assert not errors, errors[:3]


def test_memory_stays_bounded_after_ten_thousand_requests() -> None:
    """10,000 requests of 50 to 400 tokens through a store of 2**15: the tokens held, the index
    entries and the bytes allocated stop growing once it is full."""
    rng = np.random.default_rng(0)
    capacity = 1 << 15
    store = SuffixStore(capacity)
    phrases = [rng.integers(0, 2000, 30).tolist() for _ in range(50)]

    def request() -> list[int]:
        doc = rng.integers(0, 2000, int(rng.integers(50, 400))).tolist()
        doc[10:10] = phrases[int(rng.integers(0, len(phrases)))]
        return doc

    tracemalloc.start()
    try:
        for _ in range(500):  # full (about 150 requests fill it)
            store.insert(request())
        full = tracemalloc.get_traced_memory()[0]
        for _ in range(9500):
            store.insert(request())
            assert store.stats().tokens <= capacity
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    stats = store.stats()
    assert stats.inserted == 10000
    assert store.keys() <= stats.tokens <= capacity
    assert after < full * 1.1 + (1 << 20), (full, after)
    # about 140 bytes a token held with every key distinct (the table's entries, its key and
    # position objects; the ring and its links, 12 bytes a token, were allocated before
    # tracing started)
    assert after < 160 * capacity, after


def test_clear_forgets_every_document_and_the_store_fills_again() -> None:
    store = SuffixStore(64, key_length=2)
    store.insert([1, 2, 3, 4, 5])
    assert store.lookup([1, 2], 3).n == 2
    store.clear()
    assert store.lookup([1, 2], 3) == SuffixHit(0, [])
    assert (store.stats().tokens, store.stats().documents, store.keys()) == (0, 0, 0)
    for _ in range(30):  # evictions after a clear find only what was written since
        store.insert([1, 2, 7, 8, 9])
    assert store.lookup([1, 2], 3).continuations[0] == [7, 8, 9]
    assert store.stats().tokens <= 64
