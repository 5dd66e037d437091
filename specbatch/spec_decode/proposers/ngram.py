"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's suffix.

With trees (``lookup_tree``) the lookup proposes what followed each of the latest ``width``
earlier occurrences (``SpeculationTuning.tree_width``), merged into a trie where they agree:
text that repeats a phrase with different continuations (a variable name, a list's items) gets
each of them checked in the same verify.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT

import numpy as np

from specbatch.sequence import Sequence
from specbatch.spec_decode.proposers.base import (
    DraftRequest,
    LookupMatch,
    LookupPart,
    Proposal,
    Proposer,
)
from specbatch.spec_decode.proposers.suffix import SuffixStore
from specbatch.spec_decode.verification.tree import DraftTree


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


def ngram_ends(tokens: np.ndarray, n: int, limit: int) -> list[int]:
    """Where the latest ``limit`` earlier occurrences of the sequence's last ``n`` tokens end
    (the index just past each), latest first; the slow reference of
    :meth:`NgramIndex.ends`."""
    length = len(tokens)
    if not 1 <= n < length:
        return []
    windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
    hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
    return [int(h) + n for h in hits[::-1][:limit]]


def continuation_tree(tokens: SequenceT[int], ends: SequenceT[int], max_nodes: int) -> DraftTree:
    """The trie of what followed each occurrence (``ends``, latest first), cut to its best
    ``max_nodes`` nodes (:func:`frequency_tree` of the continuations)."""
    return frequency_tree([tokens[end : end + max_nodes] for end in ends], max_nodes)


def frequency_tree(continuations: SequenceT[SequenceT[int]], max_nodes: int) -> DraftTree:
    """The trie of the ``continuations`` (latest first), cut to its best ``max_nodes`` nodes:
    those the most continuations pass through (the likeliest to be the text's), then the
    shallower (a path is right only if its parent is), then the latest's. A child never ranks
    before its parent, so they form a tree; nodes in creation order (topological: one
    continuation gives its chain)."""
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    node_tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    counts: list[int] = []
    for continuation in continuations:
        parent = -1
        for depth, token in enumerate(continuation[:max_nodes]):
            node = index.get((parent, token))
            if node is None:
                node = index[(parent, token)] = len(node_tokens)
                node_tokens.append(token)
                parents.append(parent)
                depths.append(depth)
                counts.append(0)
            counts[node] += 1
            parent = node
    ranked = sorted(range(len(node_tokens)), key=lambda i: (-counts[i], depths[i], i))
    keep = sorted(ranked[:max_nodes])
    renumber = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        [node_tokens[i] for i in keep],
        [-1 if parents[i] < 0 else renumber[parents[i]] for i in keep],
    )


def heaviest_chain(continuations: SequenceT[SequenceT[int]]) -> list[int]:
    """The path of the continuations' trie that takes, from the root down, the child the
    most of them pass through (on a tie the one of the latest: the first given), found
    without building the trie (a plan asks for it for every decode, every step): identical
    continuations counted once with their number (repeated text gives many), and once a
    single one is left, the rest of it."""
    weights: dict[tuple[int, ...], int] = {}  # in order of first appearance: latest first
    for continuation in continuations:
        row = tuple(continuation)
        weights[row] = weights.get(row, 0) + 1
    alive = list(weights.items())
    chain: list[int] = []
    depth = 0
    while len(alive) > 1:
        counts: dict[int, int] = {}
        for row, weight in alive:
            if depth < len(row):
                counts[row[depth]] = counts.get(row[depth], 0) + weight
        if not counts:
            return chain
        token = max(counts, key=counts.__getitem__)  # (the first inserted of the maxima)
        chain.append(token)
        alive = [(row, w) for row, w in alive if depth < len(row) and row[depth] == token]
        depth += 1
    if alive:
        chain += alive[0][0][depth:]
    return chain


def is_chain(parents: SequenceT[int]) -> bool:
    return all(parent == i - 1 for i, parent in enumerate(parents))


class NgramIndex:
    """Where every n-gram (``min_n`` to ``max_n`` tokens) of one growing token list last ended.

    The same answers as :func:`ngram_match`, at the cost of the tokens appended since the last
    call (a few microseconds a step) instead of a scan of the whole sequence (~80 us for 600
    tokens): every decoding sequence is looked up every step, drafted or not.
    """

    def __init__(self, min_n: int, max_n: int, limit: int = 1) -> None:
        """``limit``: the latest ends of each n-gram remembered (one for a chain)."""
        self.min_n, self.max_n, self.limit = min_n, max_n, limit
        # n-gram -> the index just past each of its latest ``limit`` ends, oldest first (a
        # tuple: of ints only, the collector stops tracking it, where ~2,400 lists a 600-token
        # prompt made it scan every step's garbage against; a gen-2 pass took 83 ms at
        # batch 32, 0.9% of a run)
        self._ends: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._next_end = 0  # n-grams ending before this index are in _ends

    def match(self, tokens: list[int], max_drafts: int) -> tuple[list[int], int]:
        length = len(tokens)
        if length < self._next_end:  # the list was replaced, not extended: start again
            self._ends.clear()
            self._next_end = 0
        # an n-gram may end at length - 1 at most (the suffix itself is not a match)
        for end in range(max(self._next_end, 1), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                self._ends[key] = (*self._ends.get(key, ()), end)[-self.limit :]
        self._next_end = max(self._next_end, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            found = self._ends.get(tuple(tokens[length - n :]))
            if found is not None:
                return tokens[found[-1] : found[-1] + max_drafts], n
        return [], 0

    def ends(self, tokens: list[int], n: int) -> list[int]:
        """Where the latest earlier occurrences of the last ``n`` tokens end, latest first
        (``tokens`` as of the last :meth:`match`)."""
        if not self.min_n <= n < len(tokens) or len(tokens) != self._next_end:
            return []
        return list(self._ends.get(tuple(tokens[len(tokens) - n :]), ())[::-1])


class NgramProposer(Proposer):
    """Draft tokens copied from the sequence's own prompt and output and, with a ``store``,
    from other requests' (no draft model)."""

    def __init__(
        self,
        min_n: int,
        max_n: int,
        shortest: int | None = None,
        trees: bool = False,
        width: int = 4,
        store: SuffixStore | None = None,
    ) -> None:
        """``shortest`` (at most ``min_n``): the shortest match :meth:`match` may be asked
        for (the hybrid asks down to 1 token). ``trees``: propose the continuations of the
        latest ``width`` earlier occurrences as a tree (:meth:`tree`), and a store's match
        as its trie. ``store``: recent finished requests, looked up by :meth:`suffix_match`
        and fed by :meth:`on_finished`."""
        self.min_n = min_n
        self.max_n = max_n
        self.shortest = min_n if shortest is None else min(shortest, min_n)
        self.trees = trees
        self.width = width
        self.store = store
        self._indices: dict[int, NgramIndex] = {}

    @property
    def lookup(self) -> LookupPart:
        return self

    def match(self, seq: Sequence, max_drafts: int, min_n: int | None = None) -> LookupMatch:
        """The lookup for one sequence (``min_n`` overrides the proposer's shortest match)."""
        floor = self.min_n if min_n is None else min_n
        if floor < self.shortest:
            tokens = np.asarray(seq.token_ids, dtype=np.int64)
            return LookupMatch(*ngram_match(tokens, floor, self.max_n, max_drafts))
        index = self._indices.get(seq.seq_id)
        if index is None:
            limit = self.width if self.trees else 1
            index = self._indices[seq.seq_id] = NgramIndex(self.shortest, self.max_n, limit)
        found, n = index.match(seq.token_ids, max_drafts)
        return LookupMatch(found, n) if n >= floor else LookupMatch([], 0)

    def tree(self, seq: Sequence, max_nodes: int, n: int) -> DraftTree:
        """Up to ``max_nodes`` drafts after the latest occurrences of the last ``n`` tokens
        (``n`` as :meth:`match` found it, in this step)."""
        index = self._indices.get(seq.seq_id)
        if n >= self.shortest and index is not None:
            ends = index.ends(seq.token_ids, n)
        else:
            ends = ngram_ends(np.asarray(seq.token_ids, dtype=np.int64), n, self.width)
        return continuation_tree(seq.token_ids, ends, max_nodes)

    def suffix_match(self, seq: Sequence, max_drafts: int) -> LookupMatch:
        """The store's match for the sequence (no tokens: none, or no store): the heaviest
        path of what followed the occurrences of its longest suffix in other requests."""
        if self.store is None:
            return LookupMatch([], 0)
        hit = self.store.lookup(seq.token_ids, max_drafts)
        if not hit.n:
            return LookupMatch([], 0)
        return LookupMatch(heaviest_chain(hit.continuations), hit.n, hit.continuations)

    def drafts(
        self, seq: Sequence, match: LookupMatch, max_drafts: int
    ) -> tuple[list[int], list[int] | None]:
        """A match's drafts: its chain or, with ``trees``, the tree of the occurrences of its
        last ``n`` tokens (a store's match: of the continuations it found), and the tree's
        parents (None for a chain)."""
        if not (self.trees and match.tokens and max_drafts > 1):
            return match.tokens[:max_drafts], None
        if match.continuations is not None:
            tree = frequency_tree(match.continuations, max_drafts)
        else:
            tree = self.tree(seq, max_drafts, match.n)
        return tree.tokens, None if is_chain(tree.parents) else tree.parents

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Each request's drafts from the match the plan chose, or from its own lookup."""
        tokens: list[list[int]] = []
        parents: list[list[int] | None] = []
        for r in requests:
            match = r.lookup if r.lookup is not None else self.match(r.seq, r.max_drafts)
            drafted, tree = self.drafts(r.seq, match, r.max_drafts)
            tokens.append(drafted)
            parents.append(tree)
        return Proposal(tokens, parents=parents if any(p is not None for p in parents) else None)

    def on_finished(self, seq: Sequence) -> None:
        if self.store is not None:
            self.store.insert(seq.token_ids)

    def forget(self, seq: Sequence) -> None:
        self._indices.pop(seq.seq_id, None)
