"""The proposer interface: draft tokens for every decoding sequence of a step, at once.

A proposer declares what it is made of, and the speculator plans with that, never with its
class: a prompt-lookup part (``lookup``: matches it can be asked for before the step is
planned), a drafting network (``network``: a draft model or head, whose catch-up costs rows
and whose forwards are timed), and whether it reads the target's hidden states
(``wants_features``). A proposer with neither part (an application's) is planned as one way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specbatch.sequence import Sequence
from specbatch.spec_decode.proposers.suffix import SuffixStore


@dataclass(frozen=True)
class LookupMatch:
    """What prompt lookup found for a sequence: the tokens after the latest earlier occurrence
    of its suffix, and that suffix's length (``n``). A match in the store of other requests
    (``suffix.SuffixStore``) holds what followed each occurrence it found
    (``continuations``, latest first), and ``tokens`` is their heaviest path."""

    tokens: list[int]
    n: int
    continuations: list[list[int]] | None = None


@dataclass
class DraftRequest:
    """One decoding sequence and how many draft tokens it may get this step (>= 1).

    A proposer that can draft trees may add nodes beside its ``max_drafts``-deep chain, up to
    ``max_nodes`` in all (slots the step reserved), each when it expects it to be accepted
    with a chance above ``node_price`` (what the verify row it adds costs, in tokens).

    ``row_price`` (in tokens, 0: none) is what one verify row costs the step: a proposer that
    knows its own chance of being right may drop a draft that is not worth its row (a draft
    model makes its first draft only when its probability of it reaches the price).

    ``lookup``: the plan chose this prompt-lookup match as the sequence's drafts (a proposer
    with a lookup part drafts from it; None: the proposer drafts its own way)."""

    seq: Sequence
    max_drafts: int
    max_nodes: int = 0  # 0: max_drafts (no nodes beside the chain)
    node_price: float = float("inf")
    row_price: float = 0.0
    lookup: LookupMatch | None = None

    @property
    def slots(self) -> int:
        """Drafts it may get in all (a tree's nodes included)."""
        return max(self.max_drafts, self.max_nodes)


@dataclass
class Proposal:
    """Draft tokens per request (possibly fewer than asked, possibly none).

    ``draft_probs`` holds, for proposers that sample from a distribution, the processed draft
    distribution q of every proposed token, ``[sum of len(tokens), vocab]`` in request order;
    ``None`` marks a proposer without one (each draft is a point mass).

    ``parents`` makes a sequence's drafts a tree: draft i follows draft ``parents[s][i]`` (an
    earlier one; -1: the sequence's last token), siblings distinct; None (for the proposal or
    a sequence) is a chain. A draft model's siblings share the q row they were drawn from
    (without replacement).

    ``forward_times``: (rows, seconds) of each drafting network forward the proposal took;
    ``seconds``: the whole proposal's time (set by the speculator).
    """

    tokens: list[list[int]]
    draft_probs: torch.Tensor | None = None
    parents: list[list[int] | None] | None = None
    forward_times: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0

    def parents_of(self, s: int) -> list[int] | None:
        """Sequence ``s``'s tree (None: a chain)."""
        return None if self.parents is None else self.parents[s]

    @property
    def has_trees(self) -> bool:
        return self.parents is not None and any(p is not None for p in self.parents)


class LookupPart(Protocol):
    """Prompt lookup as a planner uses it: matched before the step is planned."""

    shortest: int  # the shortest match it may be asked for
    trees: bool  # whether its drafts may be a tree of several occurrences' continuations

    def match(self, seq: Sequence, max_drafts: int, min_n: int | None = None) -> LookupMatch:
        """The sequence's match (no tokens: none)."""
        ...

    @property
    def store(self) -> SuffixStore | None:
        """Its store of other requests' tokens, if it has one."""
        ...

    def suffix_match(self, seq: Sequence, max_drafts: int) -> LookupMatch:
        """The sequence's match in the store (no tokens: none, or no store)."""
        ...


class NetworkPart(Protocol):
    """A drafting network as a planner uses it."""

    siblings: bool  # whether it adds siblings beside its chain where they pay

    def catch_up(self, seq: Sequence) -> int:
        """Rows it computes for ``seq`` before its first draft."""
        ...


class Proposer(ABC):
    """Drafts tokens for a batch of decoding sequences; never decides what is emitted."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Draft up to ``max_drafts`` tokens for each request, batched across requests."""

    @property
    def lookup(self) -> LookupPart | None:
        """Its prompt-lookup part, if it has one."""
        return None

    @property
    def network(self) -> NetworkPart | None:
        """Its drafting network, if it has one."""
        return None

    @property
    def wants_features(self) -> bool:
        """Whether it reads the target's final-norm hidden states (``observe_features``)."""
        return False

    def observe_features(
        self, placements: list[tuple[Sequence, int, int]], features: torch.Tensor
    ) -> None:
        """The target's hidden states of a step's rows, per (sequence, first position, rows)
        in order (only called when ``wants_features``)."""
        raise NotImplementedError(f"{type(self).__name__} reads no target features")

    # Optional hooks: a stateless proposer (n-gram) keeps these no-ops.
    def on_verified(self, seq: Sequence) -> None:  # noqa: B027
        """The target accepted drafts: ``seq.num_computed_tokens`` is the valid prefix now."""

    def on_finished(self, seq: Sequence) -> None:  # noqa: B027
        """The sequence finished (not aborted): its prompt and output are final, for a
        proposer that learns across requests (called before :meth:`forget`)."""

    def forget(self, seq: Sequence) -> None:  # noqa: B027
        """The sequence finished, was aborted or preempted (its cache is gone)."""


def with_point_masses(
    tokens: list[list[int]], drafted_rows: list[int], draft_probs: torch.Tensor
) -> torch.Tensor:
    """A draft distribution's q rows in request order, with a one-hot q for every other
    request's tokens (a copied or deterministic token is a point mass, which the rejection
    sampler handles exactly)."""
    probs = draft_probs.new_zeros((sum(len(t) for t in tokens), draft_probs.shape[1]))
    from_draft = set(drafted_rows)
    out = draft = 0
    for i, row in enumerate(tokens):
        if i in from_draft:
            probs[out : out + len(row)] = draft_probs[draft : draft + len(row)]
            draft += len(row)
        else:
            probs[torch.arange(out, out + len(row)), torch.tensor(row, dtype=torch.long)] = 1.0
        out += len(row)
    return probs
