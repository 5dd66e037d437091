"""A step's draft plan, a value that travels with the step: planned when the step is
scheduled, drafted from, and learned from once the target has spoken.

Glossary (one quantity, one name): a sequence's *slots* are the cache positions reserved past
its next token (``num_lookahead``: at most ``num_speculative_tokens``, k); its *rows* are the
slots the plan uses this step, one verify row each; *drafts* are the tokens a proposer puts
in them, a chain or, where a tree branches, *nodes* (a tree's depth is its longest path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.sequence import Sequence
from specbatch.spec_decode.control.controller import Choice, PlanReport
from specbatch.spec_decode.proposers.base import DraftRequest, LookupMatch


@dataclass(frozen=True)
class Shadow:
    """Lookup drafts the step does not verify, to be compared with what the target emits
    after position ``start``: a lookup the step did not use (``offset`` 0), or the rest of one
    it used for ``offset`` drafts (judged only if all of those were accepted: the target's
    next token is then what a verify of draft ``offset`` would have compared it with)."""

    way: str
    tokens: list[int]
    start: int
    offset: int = 0


@dataclass(frozen=True)
class SeqPlan:
    """One sequence's drafts this step: the ``way`` (a lookup's ``match``, the network, an
    application's proposer) and the rows reserved for it.

    A request drafts ``chain`` deep at most (None: all its slots), a network's as a chain of
    all its slots unless ``node_price`` (tokens a node beside the chain must beat) lets it
    branch; ``row_price`` (tokens, 0: none) lets a network drop a first draft not worth its
    row. ``choice``: the controller's, which acceptance learns from (None: no controller)."""

    way: str
    rows: int
    match: LookupMatch | None = None
    chain: int | None = None
    node_price: float | None = None
    row_price: float = 0.0
    choice: Choice | None = None

    def request(self, seq: Sequence, slots: int) -> DraftRequest:
        """The proposer's request, given the ``slots`` the scheduler granted."""
        chain = slots if self.chain is None else min(self.chain, slots)
        if self.match is not None:
            return DraftRequest(seq, chain, lookup=self.match)
        if self.node_price is None:
            return DraftRequest(seq, slots, row_price=self.row_price)
        return DraftRequest(
            seq, chain, max_nodes=slots, node_price=self.node_price, row_price=self.row_price
        )


@dataclass(frozen=True)
class DraftPlan:
    """A step's plan: per sequence that drafts its ``SeqPlan``, per sequence whose lookup is
    judged against what the target emits its ``Shadow``, and the controller's report (None:
    not planned by the controller this step)."""

    seqs: dict[int, SeqPlan] = field(default_factory=dict)
    shadows: dict[int, Shadow] = field(default_factory=dict)
    report: PlanReport | None = None

    def rows(self, seq_id: int) -> int:
        """Verify rows to reserve for the sequence (the scheduler's view of the plan)."""
        planned = self.seqs.get(seq_id)
        return 0 if planned is None else planned.rows


@dataclass
class SpecCounters:
    """What one step's speculation did, for the engine's stats: sequences that verified
    drafts, their draft tokens and accepted ones, trees and the tree nodes whose K/V moved,
    per depth the verifies that reached it and those that accepted it, and the plan's
    report (None: not planned by the controller)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_tree_drafts: int = 0
    num_tree_moves: int = 0
    depths: list[tuple[int, int]] = field(default_factory=list)  # (depth, accepted)
    report: PlanReport | None = None

    def count(self, drafts: int, accepted: int, depth: int | None, path: list[int]) -> None:
        """A verify of ``drafts`` drafts (a tree's, ``depth`` levels deep; None: a chain)
        that accepted ``accepted`` of them along ``path`` (their indices, root-most first)."""
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        if depth is not None:
            self.num_tree_drafts += 1
            self.num_tree_moves += sum(node != d for d, node in enumerate(path))
        self.depths.append((drafts if depth is None else depth, accepted))
