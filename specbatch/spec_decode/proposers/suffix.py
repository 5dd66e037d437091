"""Speculation across requests: a bounded store of recent requests' prompts and outputs, looked
up with the current sequence's suffix (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975).

Batch jobs and agents repeat themselves across requests: one extraction schema over thousands
of documents, the same tool-call scaffolding, code re-sent and edited turn by turn. Prompt lookup
sees only the current request; the store sees the last ``capacity`` tokens of finished ones.

The store is a ring of token ids (finished requests, each prompt and output as one document
followed by a separator), oldest first, indexed by hash chains as in LZ77 compressors: per
``key_length``-gram the position just past its latest occurrence, and per position the one
past the occurrence before it. A lookup walks the chain of the sequence's last ``key_length``
tokens (its latest ``occurrences`` occurrences held), extends each backwards (``max_match``
tokens at most) and keeps those that match the longest suffix: the deepest node of a suffix
tree over the store that the sequence's context reaches. What followed them, merged into a
trie scored by how many occurrences pass through each node (``ngram.frequency_tree``), is the
proposal: its heaviest path as a chain, or the trie itself as a tree. The controller prices it
as its own way (``suffix``) beside the sequence's own lookups and the drafting network.

Memory is bounded: the ring and its chain links hold ``capacity`` tokens (12 bytes each), a
document that does not fit evicts the oldest ones whole, and the table of latest occurrences
holds only keys that still occur (an evicted document's keys go where nothing newer has them).
A lock makes every insert and lookup atomic: the engine's thread and a metrics scrape (or any
thread sharing the store) never see a half-written store.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

import numpy as np

from specbatch.spec_decode.tuning import SpeculationTuning

SEPARATOR = -1  # after each document: no continuation or match crosses it


@dataclass(frozen=True)
class SuffixHit:
    """A lookup's result: the matched suffix's length and what followed each occurrence that
    matched it (latest first; empty: no match)."""

    n: int
    continuations: list[list[int]]


@dataclass(frozen=True)
class StoreStats:
    """The store's counters, for ``/metrics``."""

    tokens: int = 0  # held (separators included)
    documents: int = 0  # held
    inserted: int = 0  # documents ever inserted
    lookups: int = 0
    hits: int = 0  # lookups that found a match


class SuffixStore:
    """The last ``capacity`` tokens of finished requests, indexed by ``key_length``-grams."""

    def __init__(
        self, capacity: int, key_length: int = 2, max_match: int = 16, occurrences: int = 32
    ) -> None:
        if capacity < key_length + 2:
            raise ValueError(f"a suffix store of {capacity} tokens holds no document")
        self.capacity = capacity
        self.key_length = key_length
        self.max_match = max_match
        self.occurrences = occurrences
        self._ring = np.full(capacity, SEPARATOR, dtype=np.int32)
        # per position (mod capacity): the position just past the previous occurrence of the
        # key that ends there (-1: none); links to positions evicted are never followed
        # (an array of int64, not numpy's: a lookup reads its links one by one)
        self._previous = array("q", [-1]) * capacity
        self._head = 0  # the oldest absolute position held
        self._tail = 0  # the next absolute position written
        self._documents: deque[tuple[int, int]] = deque()  # (start, stop) absolute, oldest first
        # hash of a key_length-gram -> the position just past its latest occurrence (a hash
        # collision costs a match check, never a wrong match)
        self._latest: dict[int, int] = {}
        self._lock = threading.Lock()
        self._inserted = self._lookups = self._hits = 0

    @classmethod
    def tuned(cls, capacity: int, tuning: SpeculationTuning) -> SuffixStore:
        """A store of ``capacity`` tokens with the tuning's key, match and occurrences."""
        return cls(capacity, tuning.suffix_key, tuning.suffix_match, tuning.suffix_occurrences)

    def insert(self, tokens: SequenceT[int]) -> None:
        """One finished request's prompt and output (its last ``capacity - 1`` tokens where
        longer), evicting the oldest documents it needs the room of."""
        tokens = list(tokens)[-(self.capacity - 1) :]
        if len(tokens) <= self.key_length:
            return  # nothing in it could be matched and continued
        with self._lock:
            while self._tail + len(tokens) + 1 - self._head > self.capacity:
                self._evict()
            start = self._tail
            positions = np.arange(start, start + len(tokens) + 1) % self.capacity
            self._ring[positions] = [*tokens, SEPARATOR]
            n, latest, previous = self.key_length, self._latest, self._previous
            for end in range(n, len(tokens)):  # each occurrence has a token after it
                key = hash(tuple(tokens[end - n : end]))
                previous[(start + end) % self.capacity] = latest.get(key, -1)
                latest[key] = start + end
            self._documents.append((start, start + len(tokens)))
            self._tail = start + len(tokens) + 1
            self._inserted += 1

    def _evict(self) -> None:
        """The oldest document goes, and each of its keys that nothing newer has."""
        start, stop = self._documents.popleft()
        self._head = stop + 1
        n = self.key_length
        tokens = self._read(start, stop)
        for end in range(n, stop - start):
            key = hash(tuple(tokens[end - n : end]))
            if self._latest.get(key) == start + end:
                del self._latest[key]

    def _read(self, start: int, stop: int) -> list[int]:
        """Tokens at absolute positions ``start .. stop - 1``."""
        return self._ring[np.arange(start, stop) % self.capacity].tolist()

    def lookup(self, context: SequenceT[int], depth: int) -> SuffixHit:
        """The occurrences that match the longest suffix of ``context`` (``max_match`` tokens
        at most, ``key_length`` at least) and up to ``depth`` tokens after each."""
        n = self.key_length
        with self._lock:
            self._lookups += 1
            if len(context) < n or depth < 1:
                return SuffixHit(0, [])
            end = self._latest.get(hash(tuple(context[-n:])), -1)
            ends: list[int] = []  # the latest occurrences held, latest first
            while end >= self._head and len(ends) < self.occurrences:
                ends.append(end)
                end = self._previous[end % self.capacity]
            if not ends:
                return SuffixHit(0, [])
            found = np.array(ends, dtype=np.int64)
            span = min(self.max_match, len(context))
            back = found[:, None] - 1 - np.arange(span)[None, :]
            suffix = np.asarray(context[len(context) - span :], dtype=np.int32)[::-1]
            same = (self._ring[back % self.capacity] == suffix[None, :]) & (back >= self._head)
            lengths = np.cumprod(same, axis=1).sum(axis=1)
            longest = int(lengths.max())
            if longest < n:  # only hash collisions
                return SuffixHit(0, [])
            chosen = found[lengths == longest]
            ahead = self._ring[(chosen[:, None] + np.arange(depth)[None, :]) % self.capacity]
            kept = np.cumprod(ahead != SEPARATOR, axis=1).sum(axis=1)
            self._hits += 1
            rows = [row[:k] for row, k in zip(ahead.tolist(), kept.tolist(), strict=True)]
            return SuffixHit(longest, rows)

    def clear(self) -> None:
        """Forget every document (the counters stay): a benchmark's held-out cell, or a
        deployment that must not carry one tenant's requests into another's drafts."""
        with self._lock:
            self._head = self._tail
            self._documents.clear()
            self._latest.clear()

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                self._tail - self._head,
                len(self._documents),
                self._inserted,
                self._lookups,
                self._hits,
            )

    def keys(self) -> int:
        """Keys the table of latest occurrences holds (at most one per token held)."""
        with self._lock:
            return len(self._latest)
