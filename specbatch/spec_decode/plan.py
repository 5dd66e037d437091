"""A step's draft plan, a value that travels with the step: made when the step is scheduled
(``Planner``), drafted from, and learned from once the target has spoken.

Glossary (one quantity, one name): a sequence's *slots* are the cache positions reserved past
its next token (``num_lookahead``: at most ``num_speculative_tokens``, k); its *rows* are the
slots the plan uses this step, one verify row each; *drafts* are the tokens a proposer puts
in them, a chain or, where a tree branches, *nodes* (a tree's depth is its longest path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.scheduler import ScheduledSequence, SchedulerOutput
from specbatch.sequence import Sequence
from specbatch.spec_decode.control.choices import (
    DRAFT,
    EXTERNAL,
    FORCED,
    LOOKUP_WAYS,
    SUFFIX,
    Candidate,
    Choice,
    PlanReport,
    Prices,
    Way,
    lookup_way,
)
from specbatch.spec_decode.control.controller import GoodputController
from specbatch.spec_decode.proposers.base import DraftRequest, LookupMatch, Proposer


@dataclass(frozen=True)
class Shadow:
    """Lookup drafts the step does not verify, to be compared with what the target emits
    after position ``start``: a lookup the step did not use (``offset`` 0), or the rest of one
    it used for ``offset`` drafts (judged only if all of those were accepted: the target's
    next token is then what a verify of draft ``offset`` would have compared it with)."""

    way: Way
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

    way: Way
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
    """A step's plan: per sequence that drafts its ``SeqPlan``, per sequence whose lookups
    (its own, the store's) are judged against what the target emits their shadows, and the
    controller's report (None: not planned by the controller this step)."""

    seqs: dict[int, SeqPlan] = field(default_factory=dict)
    shadows: dict[int, list[Shadow]] = field(default_factory=dict)
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
    num_forced_draft_tokens: int = 0  # drafts that were a constraint's forced tokens
    num_forced_accepted_tokens: int = 0
    depths: list[tuple[int, int]] = field(default_factory=list)  # (depth, accepted)
    # per way (a lookup's, the store's, the network's, forced...): draft tokens, accepted
    by_way: dict[Way, tuple[int, int]] = field(default_factory=dict)
    report: PlanReport | None = None

    def count(
        self, drafts: int, accepted: int, depth: int | None, path: list[int], way: Way | None
    ) -> None:
        """A verify of ``drafts`` drafts of ``way`` (None: no plan named it; a tree's,
        ``depth`` levels deep; None: a chain) that accepted ``accepted`` of them along
        ``path`` (their indices, root-most first)."""
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        if way == FORCED:
            self.num_forced_draft_tokens += drafts
            self.num_forced_accepted_tokens += accepted
        if way is not None:
            before = self.by_way.get(way, (0, 0))
            self.by_way[way] = (before[0] + drafts, before[1] + accepted)
        if depth is not None:
            self.num_tree_drafts += 1
            self.num_tree_moves += sum(node != d for d, node in enumerate(path))
        self.depths.append((drafts if depth is None else depth, accepted))


class Planner:
    """Makes each step's :class:`DraftPlan` (the scheduler's draft planner): every decode with
    slots is looked up (prompt lookup: incremental, microseconds) and, under the goodput
    controller, given a way and a count, priced rows and sibling slots; with a fixed k,
    every slot, of the one way there is (the controller still picks the way for a proposer
    of several)."""

    def __init__(
        self,
        proposer: Proposer | None,
        controller: GoodputController | None,
        adaptive: bool,
        tree_depth: int | None,
    ) -> None:
        self.proposer = proposer
        self.controller = controller
        self.adaptive = adaptive
        self.tree_depth = tree_depth

    def plan(self, out: SchedulerOutput, budget: int) -> DraftPlan:
        """Drafts per scheduled sequence for the step ``out`` (the scheduler's draft planner),
        at most ``budget`` rows in all under the controller."""
        decodes = [s for s in out.scheduled if s.num_lookahead and s.completes_sequence]
        if not self.adaptive:
            return self._fixed_plan(decodes)
        controller = self.controller
        assert controller is not None
        if any(not s.completes_sequence or s.num_new_tokens > 1 for s in out.scheduled):
            # a prompt is computed this step: its first token waits for the whole step, so
            # the step carries no drafts (speculation must not cost time to first token)
            controller.plain_step()
            return DraftPlan()
        tokens = sum(s.num_new_tokens for s in out.scheduled)
        pairs = sum(pairs_of(s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled)
        count = len(out.scheduled)
        # no lookups for a decode whose first row costs a token or more at this step (none of
        # its drafts can pay, whatever a lookup finds): it is not judged by shadows either
        most = max((s.num_lookahead for s in decodes), default=0)
        far = controller.beyond_reach(
            [s.seq.num_tokens for s in decodes], most, tokens, count, pairs
        )
        looked = [s for s, beyond in zip(decodes, far, strict=True) if not beyond]
        matches, stored = self._matches(looked), self._stored(looked)
        candidates = self._candidates(decodes, matches, stored)
        planned = controller.plan(candidates, tokens, count, pairs, budget)
        seqs: dict[int, SeqPlan] = {}
        shadows: dict[int, list[Shadow]] = {}
        for s, candidate, choice in zip(decodes, candidates, planned.choices, strict=True):
            seq_id, match = s.seq.seq_id, matches.get(s.seq.seq_id)
            if choice.way is not None:
                seqs[seq_id] = self._planned(
                    choice, candidate, match, stored.get(seq_id), planned.prices
                )
            judged = self._shadows(s.seq, match, stored.get(seq_id), choice)
            if judged:
                shadows[seq_id] = judged
        return DraftPlan(seqs, shadows, planned.report)

    def _fixed_plan(self, decodes: list[ScheduledSequence]) -> DraftPlan:
        """A fixed k: every slot of every decode, of the one way there is, or of the way the
        controller chooses for a proposer of several."""
        if self.proposer is None or not decodes:
            return DraftPlan()
        seqs: dict[int, SeqPlan] = {}
        depth = self.tree_depth  # a fixed tree: no path deeper, every node with a chance pays
        free = []
        for s in decodes:  # a constraint's only continuation first: it is certain
            forced = s.seq.constraint.forced() if s.seq.constraint is not None else []
            if forced:
                match = LookupMatch(forced, 0)
                seqs[s.seq.seq_id] = SeqPlan(FORCED, s.num_lookahead, match, depth)
            else:
                free.append(s)
        decodes = free
        matches, stored = self._matches(decodes), self._stored(decodes)
        if self.controller is not None:  # (a fixed tree's chains are no deeper than it)
            candidates = self._candidates(decodes, matches, stored, self.tree_depth)
            choices = self.controller.choose_ways(candidates)
        else:
            choices = [Choice(self._only_way(matches.get(s.seq.seq_id)), 0) for s in decodes]
        for s, choice in zip(decodes, choices, strict=True):
            seq_id, slots = s.seq.seq_id, s.num_lookahead
            if choice.way is not None and choice.way.lookup:
                seqs[seq_id] = SeqPlan(choice.way, slots, matches[seq_id], depth, choice=choice)
            elif choice.way == SUFFIX:
                seqs[seq_id] = SeqPlan(SUFFIX, slots, stored[seq_id], depth, choice=choice)
            elif choice.way is not None:
                node_price = None if depth is None else 0.0
                seqs[seq_id] = SeqPlan(
                    choice.way, slots, chain=depth, node_price=node_price, choice=choice
                )
        return DraftPlan(seqs)

    def _only_way(self, match: LookupMatch | None) -> Way | None:
        """A proposer's one way: its lookup's (None without a match), its network's, or an
        application's."""
        if match is not None:
            return lookup_way(match.n) if match.tokens else None
        return ways_of(self.proposer)[-1]

    def _matches(self, decodes: list[ScheduledSequence]) -> dict[int, LookupMatch]:
        """What prompt lookup found for each decode, if the proposer looks up."""
        lookup = self.proposer.lookup if self.proposer is not None else None
        if lookup is None:
            return {}
        return {
            s.seq.seq_id: lookup.match(s.seq, s.num_lookahead, min_n=lookup.shortest)
            for s in decodes
        }

    def _stored(self, decodes: list[ScheduledSequence]) -> dict[int, LookupMatch]:
        """What the store of other requests found for each decode, if the proposer has one."""
        lookup = self.proposer.lookup if self.proposer is not None else None
        if lookup is None or lookup.store is None:
            return {}
        return {s.seq.seq_id: lookup.suffix_match(s.seq, s.num_lookahead) for s in decodes}

    def _candidates(
        self,
        decodes: list[ScheduledSequence],
        matches: dict[int, LookupMatch],
        stored: dict[int, LookupMatch],
        depth: int | None = None,
    ) -> list[Candidate]:
        """Each decode as the controller sees it (its slots at most ``depth``)."""
        network = self.proposer.network if self.proposer is not None else None
        candidates = []
        for s in decodes:
            seq = s.seq
            match = matches.get(seq.seq_id, LookupMatch([], 0))
            catch_up = network.catch_up(seq) if network is not None else 1
            forced = seq.constraint.forced() if seq.constraint is not None else []
            suffix = stored.get(seq.seq_id)
            candidates.append(
                Candidate(
                    seq.seq_id,
                    s.num_lookahead if depth is None else min(s.num_lookahead, depth),
                    seq.num_tokens,
                    match.tokens,
                    match.n,
                    catch_up,
                    forced=forced,
                    suffix=[] if suffix is None else suffix.tokens,
                )
            )
        return candidates

    def _planned(
        self,
        choice: Choice,
        candidate: Candidate,
        match: LookupMatch | None,
        stored: LookupMatch | None,
        prices: Prices,
    ) -> SeqPlan:
        """A sequence's plan from the controller's choice: a lookup's match (its own, the
        store's), or a network's priced chain (with slots for siblings where a row costs under
        a token)."""
        assert choice.way is not None
        if choice.way.lookup:
            return SeqPlan(choice.way, choice.drafts, match, choice=choice)
        if choice.way == SUFFIX:
            return SeqPlan(SUFFIX, choice.drafts, stored, choice=choice)
        if choice.way == FORCED:
            return SeqPlan(FORCED, choice.drafts, LookupMatch(candidate.forced, 0), choice=choice)
        network = self.proposer.network if self.proposer is not None else None
        price = prices.row_tokens(candidate.context) if choice.way == DRAFT else None
        if price is None or network is None:
            return SeqPlan(choice.way, choice.drafts, choice=choice)
        if price < 1.0 and network.siblings:  # a node beside the chain may be worth its row
            assert self.controller is not None
            rows = min(candidate.slots, choice.drafts + self.controller.tuning.tree_width)
            return SeqPlan(
                DRAFT, rows, chain=choice.drafts, node_price=price, row_price=price, choice=choice
            )
        return SeqPlan(DRAFT, choice.drafts, row_price=price, choice=choice)

    def _shadows(
        self, seq: Sequence, match: LookupMatch | None, stored: LookupMatch | None, choice: Choice
    ) -> list[Shadow]:
        """What the step's lookups (the sequence's own, the store's) are judged by."""
        judged = []
        for way, found in (
            (None if match is None else lookup_way(match.n), match),
            (SUFFIX, stored),
        ):
            shadow = self._shadow(seq, way, found, choice)
            if shadow is not None:
                judged.append(shadow)
        return judged

    def _shadow(
        self, seq: Sequence, way: Way | None, match: LookupMatch | None, choice: Choice
    ) -> Shadow | None:
        """What a lookup of ``way`` is judged by: unused, against what the target emits, or
        used, its rest past the plan's drafts (else nothing ever measures the positions past
        them, and no plan drafts that deep). A probe's step teaches nothing past the plan; a
        lookup tree's rest is not one continuation."""
        if way is None or match is None or not match.tokens:
            return None
        if not (choice.way == way and choice.learned):
            return Shadow(way, match.tokens, seq.num_tokens)
        lookup = self.proposer.lookup if self.proposer is not None else None
        trees = lookup is not None and lookup.trees
        offset = choice.drafts
        if choice.planned is None and len(match.tokens) > offset and not trees:
            return Shadow(way, match.tokens[offset:], seq.num_tokens + offset, offset)
        return None


def ways_of(proposer: Proposer | None) -> tuple[Way, ...]:
    """The ways a controller chooses among for ``proposer``."""
    if proposer is None:
        return ()
    if proposer.lookup is None and proposer.network is None:
        return (EXTERNAL,)
    lookup = proposer.lookup
    lookups: tuple[Way, ...] = LOOKUP_WAYS if lookup is not None else ()
    if lookup is not None and lookup.store is not None:
        lookups += (SUFFIX,)
    return lookups + ((DRAFT,) if proposer.network is not None else ())


def pairs_of(start: int, count: int) -> int:
    """(query row, key) pairs of ``count`` rows at positions ``start`` on (causal)."""
    return count * start + count * (count + 1) // 2
