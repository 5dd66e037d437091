"""The engine's one handle on speculative decoding: who drafts how many, the drafts, the verdict.

With the goodput controller (the default) the scheduler asks :meth:`Speculator.plan` for each
decode's drafts once a step's prompts are admitted: every sampling sequence is looked up (prompt
lookup, incremental: microseconds), the controller chooses a way and a count per sequence, and
the lookups it did not use are kept to be judged against what the target emits next. Then
:meth:`propose` drafts exactly that: lookups as they are, the draft model (batched) for the
sequences given to it, an application's proposer for its own. Without the controller (a fixed
k, ``adaptive_k=False``) every reserved slot goes to the proposer. After the target's forward,
:meth:`verify` turns the logits into the accepted drafts plus one token per sequence; with no
drafts at all it is the plain sampler.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

import torch

from specbatch.kernels.sampling import sample
from specbatch.scheduler import SchedulerOutput
from specbatch.sequence import Sequence
from specbatch.spec_decode.controller import (
    DRAFT,
    EXTERNAL,
    LOOKUP_WAYS,
    Candidate,
    Choice,
    GoodputController,
    lookup_way,
)
from specbatch.spec_decode.draft_model import DraftModelProposer
from specbatch.spec_decode.eagle import EagleProposer
from specbatch.spec_decode.hybrid import HybridProposer
from specbatch.spec_decode.ngram import NgramProposer
from specbatch.spec_decode.proposer import DraftRequest, Proposal, Proposer, with_point_masses
from specbatch.spec_decode.rejection import VerifyResult, verify
from specbatch.spec_decode.tree_verify import DraftTree, tree_rows, verify_tree

UNBOUNDED_HORIZON = 256  # remaining tokens assumed for a request without max_tokens
SIBLING_SLOTS = 4  # draft-model siblings a chain may get beside it (draft_tree)


@dataclass
class _Shadow:
    """Lookup drafts the step did not verify, to be compared with what the target emits
    after ``start``: a lookup the step did not use (``offset`` 0), or the rest of one it used
    for ``offset`` drafts (judged only if all of those were accepted: the target's next token
    is then what a verify of draft ``offset`` would have compared it with)."""

    way: str
    tokens: list[int]
    start: int
    offset: int = 0


class Speculator:
    """Drafts for a step's sampling sequences and verifies them against the target's logits."""

    def __init__(
        self,
        proposer: Proposer | None,
        controller: GoodputController | None,
        generator: torch.Generator,
        tree_depth: int | None = None,
    ) -> None:
        self.proposer = proposer
        self.controller = controller
        self.tree_depth = tree_depth  # a fixed tree: every draft slot a node, this deep at most
        self.generator = generator
        self.lookup, self.drafter = _parts(proposer)
        self._plan: dict[int, Choice] = {}  # seq_id -> this step's choice
        self._lookups: dict[int, tuple[list[int], int]] = {}  # seq_id -> (drafts, match n)
        self._shadows: dict[int, _Shadow] = {}
        self.learn_past_drafts = True  # see _Shadow's offset
        self._used: dict[int, str] = {}  # seq_id -> way of this step's drafts
        self._node_prices: dict[int, float] = {}  # seq_id -> price of a sibling, in tokens
        self._row_prices: dict[int, float] = {}  # seq_id -> price of a draft model's row
        self.price_rows = True  # the draft model may drop a first draft not worth its row
        self._draft_seconds = 0.0  # of the current step: draft model or external proposer

    @staticmethod
    def controller_ways(proposer: Proposer | None) -> tuple[str, ...]:
        """The ways a controller chooses among for ``proposer``."""
        lookup, drafter = _parts(proposer)
        if proposer is None:
            return ()
        if lookup is None and drafter is None:
            return (EXTERNAL,)
        return (LOOKUP_WAYS if lookup is not None else ()) + ((DRAFT,) if drafter else ())

    # ------------------------------------------------------------------ planning

    def plan(self, out: SchedulerOutput, budget: int) -> list[int]:
        """Drafts per scheduled sequence for the step ``out`` (the scheduler's draft planner)."""
        assert self.controller is not None
        self._plan.clear()
        self._lookups.clear()
        candidates, index = [], []
        if any(not s.completes_sequence or s.num_new_tokens > 1 for s in out.scheduled):
            # a prompt is computed this step: its first token waits for the whole step, so
            # the step carries no drafts (speculation must not cost time to first token)
            self.controller.plain_step()
            return [0] * len(out.scheduled)
        for i, s in enumerate(out.scheduled):
            if s.num_lookahead and s.completes_sequence:
                candidates.append(self._candidate(s.seq, s.num_lookahead))
                index.append(i)
        tokens = sum(s.num_new_tokens for s in out.scheduled)
        pairs = sum(_pairs(s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled)
        choices = self.controller.plan(candidates, tokens, len(out.scheduled), pairs, budget)
        drafts = [0] * len(out.scheduled)
        self._node_prices.clear()
        self._row_prices.clear()
        for i, candidate, choice in zip(index, candidates, choices, strict=True):
            drafts[i] = choice.drafts
            self._plan[candidate.seq_id] = choice
            price = self._draft_row_price(choice, candidate)
            if price is not None and self.price_rows:
                self._row_prices[candidate.seq_id] = price
            if price is not None and price < 1.0 and self.drafter and self.drafter.siblings:
                # slots for siblings beside the chain (used only where they pay)
                drafts[i] = min(candidate.slots, choice.drafts + SIBLING_SLOTS)
                self._node_prices[candidate.seq_id] = price
            found, n = self._lookups.get(candidate.seq_id, ([], 0))
            seq = out.scheduled[i].seq
            if found and not (choice.way in LOOKUP_WAYS and choice.learned):
                self._shadows[seq.seq_id] = _Shadow(lookup_way(n), found, seq.num_tokens)
            elif (
                self.learn_past_drafts
                and choice.way in LOOKUP_WAYS
                and choice.planned is None  # a probe's step teaches nothing past the plan
                and len(found) > choice.drafts
                and not (self.lookup is not None and self.lookup.trees)
            ):
                # the positions past the plan's drafts are learned from the lookup's rest
                # (else nothing ever measures them, and a plan never drafts that deep)
                offset = choice.drafts
                rest = found[offset:]
                self._shadows[seq.seq_id] = _Shadow(
                    choice.way, rest, seq.num_tokens + offset, offset
                )
        return drafts

    def _draft_row_price(self, choice: Choice, candidate: Candidate) -> float | None:
        """What one more verify row for ``candidate`` costs, in tokens at the plan's goodput,
        where it drafts with the draft model on measured times (else None)."""
        controller = self.controller
        if self.drafter is None or choice.way != DRAFT or controller is None:
            return None
        rate = controller.report.tokens_per_second
        if rate <= 0.0:  # not planned on measured times yet
            return None
        return rate * controller.row_seconds(candidate.context)

    def _candidate(self, seq: Sequence, slots: int) -> Candidate:
        found: list[int] = []
        n = 0
        if self.lookup is not None:
            found, n = self.lookup.match(seq, slots, min_n=self.lookup.shortest)
            self._lookups[seq.seq_id] = (found, n)
        catch_up = self.drafter.catch_up(seq) if self.drafter is not None else 1
        return Candidate(seq.seq_id, slots, seq.num_tokens, found, n, catch_up, _remaining(seq))

    @property
    def wants_features(self) -> bool:
        """Whether the drafter reads the target's hidden states (a draft head)."""
        return isinstance(self.drafter, EagleProposer)

    def observe_features(
        self, placements: list[tuple[Sequence, int, int]], features: torch.Tensor
    ) -> None:
        """The target's final-norm hidden states of the step's rows: per (sequence, first
        position, rows) in order (an accepted tree path already at its positions)."""
        if isinstance(self.drafter, EagleProposer):
            self.drafter.observe_features(placements, features)

    @property
    def planned(self) -> bool:
        return self.controller is not None

    # ------------------------------------------------------------------ drafting

    def propose(self, seqs: SequenceT[Sequence], slots: SequenceT[int]) -> Proposal:
        """Drafts for each sequence, at most its ``slots`` (the planned count under the
        controller: the way it chose; otherwise the proposer's own choice)."""
        self._draft_seconds = 0.0
        self._used.clear()
        tokens: list[list[int]] = [[] for _ in seqs]
        wanted = [i for i, n in enumerate(slots) if n > 0]
        if self.proposer is None or not wanted:
            return Proposal(tokens)
        if self.controller is None:
            requests = [self._fixed_request(seqs[i], slots[i]) for i in wanted]
            return self._timed(self.proposer, requests, wanted, tokens)
        by_model, external = [], []
        parents: list[list[int] | None] = [None] * len(seqs)
        for i in wanted:
            seq = seqs[i]
            choice = self._plan.get(seq.seq_id)
            if choice is None or choice.way is None:
                continue
            self._used[seq.seq_id] = choice.way
            if choice.way in LOOKUP_WAYS:
                assert self.lookup is not None
                found, n = self._lookups[seq.seq_id]
                tokens[i], parents[i] = self.lookup.drafts(seq, found, n, slots[i])
            elif choice.way == DRAFT:
                by_model.append(i)
            else:
                external.append(i)
        trees = parents if any(p is not None for p in parents) else None
        if external:
            assert self.proposer is not None
            requests = [DraftRequest(seqs[i], slots[i]) for i in external]
            proposal = self._timed(self.proposer, requests, external, tokens)
        elif by_model:
            assert self.drafter is not None
            requests = [self._draft_request(seqs[i], slots[i]) for i in by_model]
            proposal = self._timed(self.drafter, requests, by_model, tokens)
        else:
            proposal = Proposal(tokens)
        proposal.parents = _merged_parents(trees, proposal.parents)
        return proposal

    def _fixed_request(self, seq: Sequence, slots: int) -> DraftRequest:
        """Without the controller: ``slots`` drafts, or with a fixed tree ``slots`` nodes at
        most ``tree_depth`` deep (every node with a chance pays: price 0)."""
        if self.tree_depth is None:
            return DraftRequest(seq, slots)
        return DraftRequest(seq, min(self.tree_depth, slots), max_nodes=slots, node_price=0.0)

    def _draft_request(self, seq: Sequence, slots: int) -> DraftRequest:
        """The draft model's request: the planned chain, the price of its rows, and the slots
        and price of siblings."""
        row_price = self._row_prices.get(seq.seq_id, 0.0)
        price = self._node_prices.get(seq.seq_id)
        if price is None:
            return DraftRequest(seq, slots, row_price=row_price)
        chain = min(self._plan[seq.seq_id].drafts, slots)
        return DraftRequest(seq, chain, max_nodes=slots, node_price=price, row_price=row_price)

    def _timed(
        self,
        proposer: Proposer,
        requests: list[DraftRequest],
        rows: list[int],
        tokens: list[list[int]],
    ) -> Proposal:
        """``proposer``'s drafts for ``requests`` (at sequence indices ``rows``) merged into
        ``tokens``; a draft distribution gains point masses for the other drafted rows."""
        started = time.perf_counter()
        proposal = proposer.propose(requests)
        self._draft_seconds = time.perf_counter() - started
        probs, row = proposal.draft_probs, 0
        q_rows: list[int] = []
        parents: list[list[int] | None] = [None] * len(tokens)
        for s, (i, drafted, r) in enumerate(zip(rows, proposal.tokens, requests, strict=True)):
            tree = proposal.parents_of(s)
            if tree is not None and len(tree) != len(drafted):
                raise ValueError(f"the proposer gave {len(drafted)} drafts but {len(tree)} parents")
            # a proposer may not exceed its slots (a tree's first nodes are a tree)
            slots = max(r.max_drafts, r.max_nodes) if tree is not None else r.max_drafts
            tokens[i] = drafted[:slots]
            parents[i] = None if tree is None else tree[:slots]
            q_rows += range(row, row + len(tokens[i]))
            row += len(drafted)
        trees = parents if any(p is not None for p in parents) else None
        if probs is None:
            return Proposal(tokens, parents=trees)
        if len(q_rows) < row:
            probs = probs[q_rows]
        drafted_rows = set(rows)
        if any(t for i, t in enumerate(tokens) if i not in drafted_rows):
            probs = with_point_masses(tokens, rows, probs)
        return Proposal(tokens, probs, trees)

    # ------------------------------------------------------------------ verifying

    def verify(
        self, logits: torch.Tensor, seqs: SequenceT[Sequence], proposal: Proposal
    ) -> VerifyResult:
        """Accepted drafts and the one correction or bonus token per sequence; ``logits`` has
        ``len(drafts) + 1`` rows per sequence, in order."""
        if not any(proposal.tokens):  # the plain, non-speculative path
            rows = [seq.sampling_row() for seq in seqs]
            sampled = sample(logits, rows, self.generator).tolist()
            return VerifyResult([0] * len(seqs), [[t] for t in sampled])
        if proposal.has_trees:
            return self._verify_trees(logits, seqs, proposal)
        rows = [
            seq.sampling_row(drafted[:j])
            for seq, drafted in zip(seqs, proposal.tokens, strict=True)
            for j in range(len(drafted) + 1)
        ]
        return verify(logits, rows, proposal.tokens, proposal.draft_probs, self.generator)

    def _verify_trees(
        self, logits: torch.Tensor, seqs: SequenceT[Sequence], proposal: Proposal
    ) -> VerifyResult:
        """A step where some sequence's drafts form a tree: every sequence's drafts (chains
        are one-branch trees) through the tree verifier. Each draft's q row is what it was
        drawn from (a looked-up token's is one-hot: exactly a point mass there)."""
        trees, rows = [], []
        q, first = proposal.draft_probs, 0
        for s, (seq, drafted) in enumerate(zip(seqs, proposal.tokens, strict=True)):
            parents = proposal.parents_of(s)
            if parents is None:
                parents = list(range(-1, len(drafted) - 1))
            q_rows = None if q is None else q[first : first + len(drafted)]
            first += len(drafted)
            tree = DraftTree(list(drafted), parents, q_rows)
            trees.append(tree)
            rows += tree_rows(seq, tree)
        result = verify_tree(logits, rows, trees, self.generator)
        return VerifyResult(result.num_accepted, result.tokens, result.accepted_nodes)

    # ------------------------------------------------------------------ learning

    def observe_step(
        self, runs: list[tuple[int, int]], seconds: float, num_drafts: int, share: float = 1.0
    ) -> None:
        """A finished step: ``(start position, tokens)`` of each sequence's run in the
        forward, the step's whole time (the draft model's or external proposer's included),
        its draft tokens, and the process's share of the cores meanwhile (CPU over wall
        seconds; 1.0 where not measured)."""
        if self.controller is None:
            return
        tokens = sum(n for _, n in runs)
        pairs = sum(_pairs(start, n) for start, n in runs)
        drafter_seconds = self._draft_seconds
        if self.drafter is not None:
            for rows, forward_seconds in self.drafter.take_forward_times():
                self.controller.observe_draft_forward(rows, forward_seconds, share)
        elif EXTERNAL in self.controller.ways:
            self.controller.observe_external(num_drafts, drafter_seconds)
        self.controller.observe_step(tokens, len(runs), pairs, seconds - drafter_seconds, share)

    def on_verified(
        self, seq: Sequence, num_drafts: int, num_accepted: int, depth: int | None = None
    ) -> None:
        """The target accepted ``num_accepted`` of the sequence's ``num_drafts`` drafts and the
        sequence's computed tokens cover them: proposers roll their own state back to it.
        ``depth``: a tree's deepest level (the positions that had a draft; a chain's is
        ``num_drafts``), which is what the controller learns acceptance by."""
        if num_drafts:
            seq.spec.record(num_drafts, num_accepted, depth)
        if depth is not None:
            num_drafts = depth
        way = self._used.get(seq.seq_id)
        choice = self._plan.get(seq.seq_id)
        if self.controller is not None and way is not None and choice is not None:
            # learned from the drafts the plan chose (a probe's extra one is not: Choice)
            planned = choice.learned
            judged = min(num_drafts, planned)
            if planned:
                self.controller.observe_made(way, planned, judged)
            if judged:
                # what the plan expected of the drafts the proposer did give (a draft model
                # may stop early): an early stop is not a miss
                expected = choice.expected[min(judged, len(choice.expected)) - 1]
                accepted = min(num_accepted, judged)
                self.controller.observe_verify(seq.seq_id, way, judged, accepted, expected)
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is not None and self.controller is not None:
            emitted = seq.token_ids[shadow.start : shadow.start + len(shadow.tokens)]
            judged = min(len(emitted), len(shadow.tokens))
            right = 0
            while right < judged and emitted[right] == shadow.tokens[right]:
                right += 1
            if shadow.offset:
                self.controller.observe_beyond(shadow.way, shadow.offset, judged, right)
            else:
                self.controller.observe_verify(seq.seq_id, shadow.way, judged, right)
        if self.proposer is not None:
            self.proposer.on_verified(seq)

    def forget(self, seq: Sequence) -> None:
        """The sequence's cache is gone (finished, aborted, preempted): so is its draft state."""
        self._shadows.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.forget(seq)
        if self.controller is not None:
            self.controller.forget(seq.seq_id)


def _parts(proposer: Proposer | None) -> tuple[NgramProposer | None, DraftModelProposer | None]:
    """The prompt lookup and the draft model a proposer is made of (None where it has none;
    an application's proposer has neither)."""
    if isinstance(proposer, HybridProposer):
        return proposer.lookup, proposer.drafter
    if isinstance(proposer, NgramProposer):
        return proposer, None
    if isinstance(proposer, DraftModelProposer):
        return None, proposer
    return None, None


def _merged_parents(
    lookups: list[list[int] | None] | None, drafted: list[list[int] | None] | None
) -> list[list[int] | None] | None:
    """The trees of a step: the lookups' and a proposer's (each sequence has one way)."""
    if lookups is None or drafted is None:
        return lookups if drafted is None else drafted
    return [a if a is not None else b for a, b in zip(lookups, drafted, strict=True)]


def _remaining(seq: Sequence) -> int:
    """Tokens the sequence may still generate (a horizon of 256 without max_tokens)."""
    max_tokens = seq.params.max_tokens
    return max(max_tokens - seq.num_output_tokens if max_tokens else UNBOUNDED_HORIZON, 1)


def _pairs(start: int, count: int) -> int:
    """(query row, key) pairs of ``count`` rows at positions ``start`` on (causal)."""
    return count * start + count * (count + 1) // 2
