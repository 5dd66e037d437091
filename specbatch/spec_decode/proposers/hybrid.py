"""Prompt lookup and a drafting network in one proposer: the composite of its two parts.

Copying spans of the prompt (summaries, extraction, code edits, answers that quote the question)
is free and often long; free text is where a network helps. The proposer does not choose
between them: the plan does (the goodput controller, per sequence per step, also under fixed
k), and each request says which way it drafts (``DraftRequest.lookup``: that match's drafts;
none: the network). The network runs once for every request given to it and catches up on the
tokens it did not see (looked-up ones included) the next time it drafts for a sequence. A
step that mixes both ways gets one verify: a looked-up token's q is one-hot (a point mass).
"""

from __future__ import annotations

import torch

from specbatch.sequence import Sequence
from specbatch.spec_decode.proposers.base import (
    DraftRequest,
    LookupPart,
    NetworkPart,
    Proposal,
    Proposer,
    with_point_masses,
)
from specbatch.spec_decode.proposers.drafting import NetworkProposer
from specbatch.spec_decode.proposers.ngram import NgramProposer


class HybridProposer(Proposer):
    """Each request's drafts from the lookup match its plan chose, or from the network."""

    def __init__(self, lookup: NgramProposer, network: NetworkProposer) -> None:
        self._lookup = lookup
        self._network = network

    @property
    def lookup(self) -> LookupPart:
        return self._lookup

    @property
    def network(self) -> NetworkPart:
        return self._network

    @property
    def wants_features(self) -> bool:
        return self._network.wants_features

    def observe_features(
        self, placements: list[tuple[Sequence, int, int]], features: torch.Tensor
    ) -> None:
        self._network.observe_features(placements, features)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        tokens: list[list[int]] = [[] for _ in requests]
        parents: list[list[int] | None] = [None] * len(requests)
        to_draft = []
        for i, r in enumerate(requests):
            if r.lookup is None:
                to_draft.append(i)
            else:
                tokens[i], parents[i] = self._lookup.drafts(r.seq, r.lookup, r.max_drafts)
        if not to_draft:
            return Proposal(tokens, parents=_trees(parents))
        drafted = self._network.propose([requests[i] for i in to_draft])
        for s, i in enumerate(to_draft):
            tokens[i], parents[i] = drafted.tokens[s], drafted.parents_of(s)
        probs = drafted.draft_probs
        if probs is not None:
            probs = with_point_masses(tokens, to_draft, probs)
        return Proposal(tokens, probs, _trees(parents), drafted.forward_times)

    def on_verified(self, seq: Sequence) -> None:
        self._network.on_verified(seq)

    def on_finished(self, seq: Sequence) -> None:
        self._lookup.on_finished(seq)

    def forget(self, seq: Sequence) -> None:
        self._lookup.forget(seq)
        self._network.forget(seq)


def _trees(parents: list[list[int] | None]) -> list[list[int] | None] | None:
    return parents if any(p is not None for p in parents) else None
