"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's suffix."""

from __future__ import annotations

import numpy as np

from specbatch.spec.proposer import DraftRequest, Proposal, Proposer


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The tokens after the most recent earlier match of the longest suffix n-gram.

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
            return tokens[start : start + max_drafts].tolist()
    return []


class NgramProposer(Proposer):
    """Draft tokens copied from the sequence's own prompt and output (no draft model)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return Proposal(
            tokens=[
                ngram_propose(
                    np.asarray(r.seq.token_ids, dtype=np.int64),
                    self.min_n,
                    self.max_n,
                    r.max_drafts,
                )
                for r in requests
            ]
        )
