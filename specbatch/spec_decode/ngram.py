"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's suffix."""

from __future__ import annotations

import numpy as np

from specbatch.sequence import Sequence
from specbatch.spec_decode.proposer import DraftRequest, Proposal, Proposer


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The tokens after the most recent earlier match of the longest suffix n-gram."""
    return ngram_match(tokens, min_n, max_n, max_drafts)[0]


def ngram_match(
    tokens: np.ndarray, min_n: int, max_n: int, max_drafts: int
) -> tuple[list[int], int]:
    """The tokens after the most recent earlier match of the longest suffix n-gram, and that
    n (0 and no tokens without a match).

    Tries n from ``max_n`` down to ``min_n``; the first n with a match wins. A match must end
    before the last token (the suffix itself is not a match). The slow, obvious reference of
    :class:`NgramIndex` (a scan of the whole sequence per call).
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # windows[i] = tokens[i : i + n]; candidates end at most at length - 2
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + max_drafts].tolist(), n
    return [], 0


class NgramIndex:
    """Where every n-gram (``min_n`` to ``max_n`` tokens) of one growing token list last ended.

    The same answers as :func:`ngram_match`, at the cost of the tokens appended since the last
    call (a few microseconds a step) instead of a scan of the whole sequence (~80 us for 600
    tokens): every decoding sequence is looked up every step, drafted or not.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its latest end
        self._next_end = 0  # n-grams ending before this index are in _ends

    def match(self, tokens: list[int], max_drafts: int) -> tuple[list[int], int]:
        length = len(tokens)
        if length < self._next_end:  # the list was replaced, not extended: start again
            self._ends.clear()
            self._next_end = 0
        # an n-gram may end at length - 1 at most (the suffix itself is not a match)
        for end in range(max(self._next_end, 1), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self._next_end = max(self._next_end, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            found = self._ends.get(tuple(tokens[length - n :]))
            if found is not None:
                return tokens[found : found + max_drafts], n
        return [], 0


class NgramProposer(Proposer):
    """Draft tokens copied from the sequence's own prompt and output (no draft model)."""

    def __init__(self, min_n: int, max_n: int, shortest: int | None = None) -> None:
        """``shortest`` (at most ``min_n``): the shortest match :meth:`match` may be asked
        for (the hybrid asks down to 1 token)."""
        self.min_n = min_n
        self.max_n = max_n
        self.shortest = min_n if shortest is None else min(shortest, min_n)
        self._indices: dict[int, NgramIndex] = {}

    def match(
        self, seq: Sequence, max_drafts: int, min_n: int | None = None
    ) -> tuple[list[int], int]:
        """The lookup for one sequence and the matched suffix length (``min_n`` overrides the
        proposer's shortest)."""
        floor = self.min_n if min_n is None else min_n
        if floor < self.shortest:
            tokens = np.asarray(seq.token_ids, dtype=np.int64)
            return ngram_match(tokens, floor, self.max_n, max_drafts)
        index = self._indices.get(seq.seq_id)
        if index is None:
            index = self._indices[seq.seq_id] = NgramIndex(self.shortest, self.max_n)
        found, n = index.match(seq.token_ids, max_drafts)
        return (found, n) if n >= floor else ([], 0)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return Proposal(tokens=[self.match(r.seq, r.max_drafts)[0] for r in requests])

    def forget(self, seq: Sequence) -> None:
        self._indices.pop(seq.seq_id, None)
