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
    before the last token (the suffix itself is not a match). Vectorised: O(len * n) per n.
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


class NgramProposer(Proposer):
    """Draft tokens copied from the sequence's own prompt and output (no draft model)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def match(
        self, seq: Sequence, max_drafts: int, min_n: int | None = None
    ) -> tuple[list[int], int]:
        """The lookup for one sequence and the matched suffix length (``min_n`` overrides the
        proposer's shortest)."""
        tokens = np.asarray(seq.token_ids, dtype=np.int64)
        floor = self.min_n if min_n is None else min_n
        return ngram_match(tokens, floor, self.max_n, max_drafts)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return Proposal(tokens=[self.match(r.seq, r.max_drafts)[0] for r in requests])
