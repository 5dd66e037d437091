"""The engine's one handle on speculative decoding: plan, draft, verify, settle, learn.

Each call takes what the step has so far and returns a value; nothing of one step is kept on
the speculator for the next (the controller, the proposers and their caches keep what they
learn). For a step:

1. ``plan`` (the scheduler's draft planner, once the step's prompts are admitted): the
   step's :class:`~specbatch.spec_decode.plan.DraftPlan` (made by ``plan.Planner``), carried
   on the step.
2. ``propose``: the plan's drafts, one batched call to the proposer.
3. ``verify``: the target's logits to the accepted drafts plus one token per sequence (with
   no drafts at all, the plain sampler).
4. ``settle``: a tree's accepted path moved to the sequence's positions in every cache the
   step wrote; a draft head handed the target's features of the step's rows.
5. ``learn``: the proposers roll their state back to what was accepted, the controller learns
   acceptance (unused lookups judged against what the target emitted) and the step's time;
   the step's counters come back for the engine's stats.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceT
from typing import Protocol

import numpy as np
import torch

from specbatch.kernels.sampling import sample
from specbatch.runner.flat_batch import TokenRun, cache_slots
from specbatch.scheduler import ScheduledSequence, SchedulerOutput
from specbatch.sequence import Sequence
from specbatch.spec_decode.control.choices import EXTERNAL, FORCED
from specbatch.spec_decode.control.controller import GoodputController
from specbatch.spec_decode.control.step_times import StepClock
from specbatch.spec_decode.plan import DraftPlan, Planner, SpecCounters, pairs_of
from specbatch.spec_decode.proposers.base import (
    DraftRequest,
    Proposal,
    Proposer,
    with_point_masses,
)
from specbatch.spec_decode.proposers.suffix import StoreStats
from specbatch.spec_decode.verification.chain import VerifyResult, verify
from specbatch.spec_decode.verification.tree import DraftTree, node_depths, tree_rows, verify_tree


class TargetRunner(Protocol):
    """What ``settle`` needs of the target's runner."""

    @property
    def block_size(self) -> int: ...

    @property
    def hidden(self) -> tuple[torch.Tensor, np.ndarray] | None:
        """The last forward's final-norm hidden states and its runs' row offsets."""
        ...

    def move_slots(self, sources: SequenceT[int], targets: SequenceT[int]) -> None: ...


class Speculator:
    """Drafts for a step's sampling sequences and verifies them against the target's logits."""

    def __init__(
        self,
        proposer: Proposer | None,
        controller: GoodputController | None,
        generator: torch.Generator,
        adaptive: bool = True,
        tree_depth: int | None = None,
    ) -> None:
        """``adaptive``: the controller chooses each sequence's drafts (else every slot, and
        a controller only chooses the way); ``tree_depth``: a fixed tree, every slot a node,
        this deep at most."""
        self.proposer = proposer
        self.controller = controller
        self.adaptive = adaptive and controller is not None
        self.generator = generator
        self.planner = Planner(proposer, controller, self.adaptive, tree_depth)

    @property
    def wants_features(self) -> bool:
        """Whether the proposer reads the target's hidden states (a draft head)."""
        return self.proposer is not None and self.proposer.wants_features

    def clock(self) -> StepClock:
        """A clock for a step starting now (``learn`` reads it)."""
        return StepClock(on_cpu=self.generator.device.type == "cpu")

    def plan(self, out: SchedulerOutput, budget: int) -> DraftPlan:
        """The step's draft plan (the scheduler's draft planner; see ``Planner``)."""
        return self.planner.plan(out, budget)

    # ------------------------------------------------------------------ drafting

    def propose(self, plan: DraftPlan | None, sampling: list[ScheduledSequence]) -> Proposal:
        """The plan's drafts for each sampling sequence, at most its granted slots."""
        tokens: list[list[int]] = [[] for _ in sampling]
        rows, requests = [], []
        forced: list[bool] = []
        for i, s in enumerate(sampling):
            planned = None if plan is None else plan.seqs.get(s.seq.seq_id)
            if planned is not None and s.num_lookahead:
                rows.append(i)
                requests.append(planned.request(s.seq, s.num_lookahead))
                forced.append(planned.way == FORCED)
        if self.proposer is None or not requests:
            return Proposal(tokens)
        started = time.perf_counter()
        proposal = self._proposed(requests, forced)
        seconds = time.perf_counter() - started
        probs, row = proposal.draft_probs, 0
        q_rows: list[int] = []
        parents: list[list[int] | None] = [None] * len(sampling)
        for k, (i, drafted, r) in enumerate(zip(rows, proposal.tokens, requests, strict=True)):
            tree = proposal.parents_of(k)
            if tree is not None and len(tree) != len(drafted):
                raise ValueError(f"the proposer gave {len(drafted)} drafts but {len(tree)} parents")
            keep = _kept(sampling[i].seq, drafted, tree, r)
            tokens[i] = [drafted[j] for j in keep]
            if tree is not None:
                index = {old: new for new, old in enumerate(keep)}
                parents[i] = [-1 if tree[j] < 0 else index[tree[j]] for j in keep]
            q_rows += [row + j for j in keep]
            row += len(drafted)
        if probs is not None and len(q_rows) < row:
            probs = probs[q_rows]
        trees = parents if any(p is not None for p in parents) else None
        return Proposal(tokens, probs, trees, proposal.forward_times, seconds)

    def _proposed(self, requests: list[DraftRequest], forced: list[bool]) -> Proposal:
        """The proposer's drafts for the requests it drafts, and a constraint's forced tokens
        (point masses, no proposer needed) for the others, in request order."""
        assert self.proposer is not None
        if not any(forced):
            return self.proposer.propose(requests)
        asked = [i for i, f in enumerate(forced) if not f]
        drafted = self.proposer.propose([requests[i] for i in asked]) if asked else Proposal([])
        tokens: list[list[int]] = []
        parents: list[list[int] | None] = []
        for i, r in enumerate(requests):
            if forced[i]:
                assert r.lookup is not None
                tokens.append(r.lookup.tokens[: r.max_drafts])
                parents.append(None)
            else:
                k = asked.index(i)
                tokens.append(drafted.tokens[k])
                parents.append(drafted.parents_of(k))
        probs = drafted.draft_probs
        if probs is not None:
            probs = with_point_masses(tokens, asked, probs)
        trees = parents if any(p is not None for p in parents) else None
        return Proposal(tokens, probs, trees, drafted.forward_times)

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

    # ------------------------------------------------------------------ settling

    def settle(
        self,
        runner: TargetRunner,
        scheduled: list[ScheduledSequence],
        runs: list[TokenRun],
        result: VerifyResult,
    ) -> None:
        """After the verify, before the cache commits a block of the step: a tree's accepted
        path, computed at the cache slots of its nodes' indices, moves to the sequence's next
        positions (in every cache the step wrote), and a draft head gets the target's hidden
        states of every row of the step, each accepted path's rows at their positions."""
        sampling = [s for s in scheduled if s.completes_sequence]
        paths: dict[int, list[int]] = {}
        if result.accepted_nodes is not None:
            paths = {
                s.seq.seq_id: nodes
                for s, nodes in zip(sampling, result.accepted_nodes, strict=True)
            }
            self._move_paths(runner, sampling, paths)
        if self.wants_features and runner.hidden is not None:
            assert self.proposer is not None
            self.proposer.observe_features(*_features(runner.hidden, scheduled, runs, paths))

    @staticmethod
    def _move_paths(
        runner: TargetRunner, sampling: list[ScheduledSequence], paths: dict[int, list[int]]
    ) -> None:
        sources: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        for s in sampling:
            seq = s.seq
            first = seq.num_computed_tokens + s.num_new_tokens  # where draft 0 was written
            moved = [(node, depth) for depth, node in enumerate(paths[seq.seq_id]) if node != depth]
            if not moved:
                continue
            table = np.asarray(seq.block_table)
            nodes, depths = (np.array(column) for column in zip(*moved, strict=True))
            sources.append(cache_slots(table, first + nodes, runner.block_size))
            targets.append(cache_slots(table, first + depths, runner.block_size))
        if sources:
            runner.move_slots(np.concatenate(sources).tolist(), np.concatenate(targets).tolist())

    # ------------------------------------------------------------------ learning

    def learn(
        self,
        plan: DraftPlan | None,
        sampling: list[ScheduledSequence],
        proposal: Proposal,
        result: VerifyResult,
        finished: list[Sequence],
        runs: list[TokenRun],
        clock: StepClock,
    ) -> SpecCounters:
        """A step done (its tokens appended, its computed tokens committed): every sampling
        sequence's proposer state rolls back to what was accepted and the controller learns
        from it, finished sequences are forgotten, and the controller learns the step's time
        (``clock``'s, from the step's start: the proposal's included, the draft network's
        forwards timed on their own). The step's counters for the engine's stats."""
        counters = SpecCounters(report=None if plan is None else plan.report)
        for i, (s, drafted, accepted) in enumerate(
            zip(sampling, proposal.tokens, result.num_accepted, strict=True)
        ):
            tree = proposal.parents_of(i)
            depth = None if tree is None else max(node_depths(tree), default=0)
            if drafted:
                planned = None if plan is None else plan.seqs.get(s.seq.seq_id)
                way = None if planned is None else planned.way
                counters.count(len(drafted), accepted, depth, result.path(i), way)
            self._verified(s, plan, len(drafted), accepted, depth)
        for seq in finished:
            if self.proposer is not None:
                self.proposer.on_finished(seq)
            self.forget(seq)
        if self.controller is not None:
            self._observe_step(runs, proposal, clock)
        return counters

    def _verified(
        self,
        s: ScheduledSequence,
        plan: DraftPlan | None,
        num_drafts: int,
        num_accepted: int,
        depth: int | None,
    ) -> None:
        """The target accepted ``num_accepted`` of the sequence's ``num_drafts`` drafts (a
        tree's ``depth`` levels: what acceptance is learned by) and its computed tokens cover
        them: proposers roll their own state back to it, the controller learns."""
        seq = s.seq
        if num_drafts:
            seq.spec.record(num_drafts, num_accepted, depth)
        if depth is not None:
            num_drafts = depth
        planned = None if plan is None or not s.num_lookahead else plan.seqs.get(seq.seq_id)
        controller = self.controller
        if controller is not None and planned is not None and planned.choice is not None:
            # learned from the drafts the plan chose (a probe's extra one is not: Choice)
            choice, way = planned.choice, planned.way
            judged = min(num_drafts, choice.learned)
            if choice.learned:
                controller.observe_made(way, choice.learned, judged)
            if judged:
                # what the plan expected of the drafts the proposer did give (a network may
                # stop early): an early stop is not a miss
                expected = choice.expected[min(judged, len(choice.expected)) - 1]
                accepted = min(num_accepted, judged)
                controller.observe_verify(seq.seq_id, way, judged, accepted, expected)
        shadows = () if plan is None or controller is None else plan.shadows.get(seq.seq_id, [])
        for shadow in shadows:
            assert controller is not None
            emitted = seq.token_ids[shadow.start : shadow.start + len(shadow.tokens)]
            judged = min(len(emitted), len(shadow.tokens))
            right = 0
            while right < judged and emitted[right] == shadow.tokens[right]:
                right += 1
            if shadow.offset:
                controller.observe_beyond(shadow.way, shadow.offset, judged, right)
            else:
                controller.observe_verify(seq.seq_id, shadow.way, judged, right)
        if self.proposer is not None:
            self.proposer.on_verified(seq)

    def _observe_step(self, runs: list[TokenRun], proposal: Proposal, clock: StepClock) -> None:
        """The step's forward size and time, the proposal's apart (the draft network's
        forwards go to their own model; an application's proposer's per draft)."""
        controller = self.controller
        assert controller is not None
        seconds, share = clock.read()
        tokens = sum(len(r.token_ids) for r in runs)
        pairs = sum(pairs_of(r.start_position, len(r.token_ids)) for r in runs)
        if self.proposer is not None and self.proposer.network is not None:
            for rows, forward_seconds in proposal.forward_times:
                controller.observe_draft_forward(rows, forward_seconds, share)
        elif EXTERNAL in controller.ways:
            drafts = sum(len(t) for t in proposal.tokens)
            controller.observe_external(drafts, proposal.seconds)
        decodes = all(len(r.token_ids) == 1 + r.num_drafts for r in runs)
        seconds -= proposal.seconds
        controller.observe_step(tokens, len(runs), pairs, seconds, share, decodes)

    def store_stats(self) -> StoreStats | None:
        """The counters of the proposer's store of other requests' tokens (None: none)."""
        lookup = self.proposer.lookup if self.proposer is not None else None
        store = None if lookup is None else lookup.store
        return None if store is None else store.stats()

    def forget(self, seq: Sequence) -> None:
        """The sequence's cache is gone (finished, aborted, preempted): so is its draft state."""
        if self.proposer is not None:
            self.proposer.forget(seq)
        if self.controller is not None:
            self.controller.forget(seq.seq_id)


def _kept(
    seq: Sequence, drafted: list[int], tree: list[int] | None, request: DraftRequest
) -> list[int]:
    """The drafts of ``drafted`` a step verifies: at most the request's slots (a proposer may
    not exceed them; a tree's first nodes are a tree) and, under a constraint, none past a
    draft the constraint refuses (that one stays: the target's masked distribution rejects it
    with certainty, and the rejection's residual keeps a sampled draft's row exact)."""
    slots = request.slots if tree is not None else request.max_drafts
    count = min(len(drafted), slots)
    constraint = seq.constraint
    if constraint is None:
        return list(range(count))
    if tree is None:
        return list(range(min(count, constraint.valid_prefix(drafted[:count]) + 1)))
    keep: list[int] = []
    valid: list[bool] = []  # per node: its path is allowed
    for j in range(count):
        parent = tree[j]
        if parent >= 0 and not valid[parent]:
            valid.append(False)
            continue  # (and it is not kept: its parent is never accepted)
        path = [drafted[n] for n in _path(tree, j)]
        valid.append(constraint.valid_prefix(path) == len(path))
        if parent < 0 or parent in keep:
            keep.append(j)
    return keep


def _path(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _features(
    kept: tuple[torch.Tensor, np.ndarray],
    scheduled: list[ScheduledSequence],
    runs: list[TokenRun],
    paths: dict[int, list[int]],
) -> tuple[list[tuple[Sequence, int, int]], torch.Tensor]:
    """The step's hidden rows per (sequence, first position, rows), each tree's accepted path
    moved to its positions as its K/V was."""
    hidden, query_start = kept
    order: list[int] = []
    placements = []
    for b, (s, run) in enumerate(zip(scheduled, runs, strict=True)):
        first = int(query_start[b])
        rows = list(range(first, first + len(run.token_ids)))
        for depth, node in enumerate(paths.get(s.seq.seq_id, ())):
            rows[s.num_new_tokens + depth] = first + s.num_new_tokens + node
        order += rows
        placements.append((s.seq, run.start_position, len(rows)))
    index = torch.tensor(order, dtype=torch.long, device=hidden.device)
    return placements, hidden.index_select(0, index)
