"""Drafting with a network (a draft model or a draft head): the chain and tree loops.

The network keeps its own paged cache on the target's block ids, so the target's allocation
(with its lookahead slots) governs both. Per sequence the proposer remembers how many leading
tokens that cache holds. A chain first *catches up* on the tokens the network has not seen
(after a verify: the last accepted draft and/or the correction token; for a new sequence its
whole prompt) and draws the first draft from the last row; then one single-token forward per
further draft, batched over every sequence still drafting. A sequence stops after the draft
that brings the network's probability that all its drafts so far are right (the product of
its probabilities of the tokens it drafted) below ``confidence_threshold`` (that draft is
kept: its forward is paid, a verify row is cheap). After a verify the valid prefix shrinks to
the accepted tokens the cache holds (``on_verified``): that is the network's rollback.

Priced first drafts (a request's ``row_price``, what a verify row costs in tokens): the first
draft is made only if the network's probability of it reaches the price, and a chain goes on
only while its product does too. On greedy and seeded rows any such rule is exact (the
verifier matches the target's own token); on an unseeded random row a kept first draft is
judged by q restricted to the tokens that reach the price (``restricted``): what it was drawn
from. A dropped draft's position is the target's own sample.

Trees, where a request's ``node_price`` lets nodes beside its chain pay: the chain's leaf
siblings (``draft_trees.with_siblings``: no extra forward), or with ``dynamic_trees``
EAGLE-2's dynamic tree (``draft_trees.GrowingTree``: one forward per level under a tree mask).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from specbatch.kernels.sampling import (
    SamplingRow,
    SamplingTensors,
    apply_penalties,
    greedy_tokens,
    sample_rows,
    target_probs,
)
from specbatch.runner.flat_batch import TokenRun
from specbatch.sampling_params import SamplingParams
from specbatch.sequence import Sequence
from specbatch.spec_decode.proposers.base import (
    DraftRequest,
    NetworkPart,
    Proposal,
    Proposer,
    with_point_masses,
)
from specbatch.spec_decode.proposers.draft_trees import GrowingTree, TreeLevel, with_siblings


class DraftNetwork(ABC):
    """What the drafting loops need of a network: logits at a chain's next position, logits
    at a tree level's nodes, and its own paged cache (bound once, on the target's block ids)."""

    # whether its cache rows at draft positions stay valid where the target accepted them (a
    # draft model's; a head's read its own features there, so they never do)
    keeps_drafts: bool = True
    wants_features: bool = False

    @abstractmethod
    def bind_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate and bind its K/V on ``num_blocks`` blocks of ``block_size`` slots."""

    @abstractmethod
    def draft_logits(self, runs: list[TokenRun], seqs: list[Sequence], step: int) -> torch.Tensor:
        """Logits over the target vocabulary at the last row of each run (one run per
        sequence of ``seqs``; ``step`` 0 is the catch-up, then one draft token each)."""

    @abstractmethod
    def level_logits(
        self, runs: list[TokenRun], levels: list[TreeLevel], wanted: list[list[int]]
    ) -> torch.Tensor:
        """Logits over the target vocabulary at each run's ``wanted`` rows (run-relative), in
        order: one forward over every sequence's tree so far, each under its tree mask."""

    def observe_features(
        self, placements: list[tuple[Sequence, int, int]], features: torch.Tensor
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} reads no target features")

    def forget(self, seq: Sequence) -> None:  # noqa: B027
        """The sequence's cache is gone."""


class NetworkProposer(Proposer):
    """Drafts with a network, sampling each draft from its processed distribution q."""

    def __init__(
        self,
        network: DraftNetwork,
        num_blocks: int,
        block_size: int,
        generator: torch.Generator,
        confidence_threshold: float = 0.0,
        siblings: bool = False,
        dynamic_trees: bool = False,
        tree_width: int = 4,
    ) -> None:
        """``tree_width``: a tree node's children looked at (``draft_trees``)."""
        network.bind_cache(num_blocks, block_size)
        self.net = network
        self.generator = generator
        self.confidence_threshold = confidence_threshold
        self.siblings = siblings
        # where nodes beside the chain pay: EAGLE-2's dynamic tree (a forward per level)
        # instead of siblings of the chain (no extra forward)
        self.dynamic_trees = dynamic_trees
        self.tree_width = tree_width
        self._computed: dict[int, int] = {}  # seq_id -> leading tokens held by its cache
        # seq_id -> (position of the first draft, the chain): what the cache holds past the
        # sequence's tokens, checked against what the target accepted
        self._chains: dict[int, tuple[int, list[int]]] = {}

    @property
    def network(self) -> NetworkPart:
        return self

    @property
    def wants_features(self) -> bool:
        return self.net.wants_features

    def observe_features(
        self, placements: list[tuple[Sequence, int, int]], features: torch.Tensor
    ) -> None:
        self.net.observe_features(placements, features)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """With ``dynamic_trees``, a dynamic tree for the requests whose price lets nodes
        beside the chain pay; a chain (with siblings where they pay, if not
        ``dynamic_trees``) for the others."""
        growing = [i for i, r in enumerate(requests) if self._grows_tree(r)]
        if not growing:
            return self._chain_proposal(requests)
        chains = [i for i, r in enumerate(requests) if not self._grows_tree(r)]
        tokens: list[list[int]] = [[] for _ in requests]
        parents: list[list[int] | None] = [None] * len(requests)
        q_rows: dict[int, torch.Tensor] = {}  # request -> q of its drafts (chains that sample)
        times: list[tuple[int, float]] = []
        if chains:
            chained = self._chain_proposal([requests[i] for i in chains])
            times += chained.forward_times
            row = 0
            for s, i in enumerate(chains):
                tokens[i], parents[i] = chained.tokens[s], chained.parents_of(s)
                if chained.draft_probs is not None:
                    q_rows[i] = chained.draft_probs[row : row + len(tokens[i])]
                row += len(chained.tokens[s])
        grown = self._grow_trees([requests[i] for i in growing], times)
        for i, (nodes, links) in zip(growing, grown, strict=True):
            tokens[i], parents[i] = nodes, links
        trees = parents if any(p is not None for p in parents) else None
        if not q_rows:
            return Proposal(tokens, None, trees, times)
        # a grown tree's nodes are point masses
        sampled = sorted(q_rows)
        probs = with_point_masses(tokens, sampled, torch.cat([q_rows[i] for i in sampled]))
        return Proposal(tokens, probs, trees, times)

    def _may_branch(self, r: DraftRequest) -> bool:
        return self.siblings and r.max_nodes > r.max_drafts and r.node_price < 1.0

    def _grows_tree(self, r: DraftRequest) -> bool:
        return self.dynamic_trees and self._may_branch(r)

    def _catch_up_runs(self, seqs: list[Sequence]) -> list[TokenRun]:
        """Each sequence's tokens the network's cache does not hold yet."""
        runs = []
        for seq in seqs:
            start = self._computed.get(seq.seq_id, 0)
            runs.append(TokenRun(seq.token_ids[start:], start, seq.block_table))
        return runs

    def _chain_proposal(self, requests: list[DraftRequest]) -> Proposal:
        """Each request's chain: drafts one batched forward per position, with siblings where
        ``_may_branch``."""
        chains = _Chains(requests, {i for i, r in enumerate(requests) if self._may_branch(r)})
        times: list[tuple[int, float]] = []
        active = list(range(len(requests)))
        runs = self._catch_up_runs([r.seq for r in requests])
        for step in range(max(r.max_drafts for r in requests)):
            started = time.perf_counter()
            logits = self.net.draft_logits(runs, [requests[i].seq for i in active], step)
            for i, run in zip(active, runs, strict=True):
                self._computed[requests[i].seq.seq_id] = run.start_position + len(run.token_ids)
            rows = [requests[i].seq.sampling_row(chains.tokens[i]) for i in active]
            want = [row for row, i in enumerate(active) if i in chains.branching]
            drafted, q, chosen, likeliest = self._sample(
                logits, rows, chains.keep_probs, want, need_chosen=bool(chains.priced)
            )
            dropped = chains.take(step, active, drafted, q, chosen, likeliest)
            times.append((sum(len(run.token_ids) for run in runs), time.perf_counter() - started))
            active = chains.going_on(active, step, dropped, self.confidence_threshold)
            runs = [
                TokenRun(
                    [chains.tokens[i][-1]],
                    requests[i].seq.num_tokens + step,
                    requests[i].seq.block_table,
                )
                for i in active
            ]
            if not active:
                break
        for r, chain in zip(requests, chains.tokens, strict=True):
            self._chains[r.seq.seq_id] = (r.seq.num_tokens, list(chain))
        proposal = chains.proposal()
        proposal.forward_times = times
        return proposal

    def _grow_trees(
        self, requests: list[DraftRequest], times: list[tuple[int, float]]
    ) -> list[tuple[list[int], list[int]]]:
        """EAGLE-2's dynamic draft tree per request (``GrowingTree``): from the network's
        distribution after the catch-up, each level expands the likeliest nodes into their
        likeliest children, one batched forward per level over every sequence's tree so far
        (under its tree mask); the nodes kept are the likeliest chain while confident plus
        every other node whose path probability beats the request's ``node_price``. Each node
        is a point mass (exact under every sampling mode: the verifier's residual drops a
        rejected one). Each forward's (rows, seconds) is appended to ``times``."""
        started = time.perf_counter()
        seqs = [r.seq for r in requests]
        runs = self._catch_up_runs(seqs)
        logits = self.net.draft_logits(runs, seqs, 0)
        trees = [GrowingTree(r, self.tree_width) for r in requests]
        for tree, row in zip(trees, torch.softmax(logits.float(), dim=-1), strict=True):
            tree.add_children(-1, row, self.confidence_threshold)
        for seq in seqs:
            self._computed[seq.seq_id] = seq.num_tokens
        times.append((sum(len(run.token_ids) for run in runs), time.perf_counter() - started))
        depth = 1
        while expanding := [(i, e) for i, t in enumerate(trees) if (e := t.to_expand(depth))]:
            started = time.perf_counter()
            levels = [trees[i].level(seqs[i], nodes) for i, nodes in expanding]
            logits = self.net.level_logits(
                [level.run for level in levels], levels, [level.wanted for level in levels]
            )
            owners = [(i, n) for i, nodes in expanding for n in nodes]
            for (i, n), row in zip(owners, torch.softmax(logits, dim=-1), strict=True):
                trees[i].add_children(n, row, self.confidence_threshold)
            rows = sum(len(level.run.token_ids) for level in levels)
            times.append((rows, time.perf_counter() - started))
            depth += 1
        for seq in seqs:
            self._chains[seq.seq_id] = (seq.num_tokens, [])  # the cache holds nothing past
        return [tree.kept() for tree in trees]

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        need_q: bool,
        likeliest: list[int],
        need_chosen: bool = False,
    ) -> tuple[list[int], torch.Tensor | None, list[float], dict[int, list[tuple[float, int]]]]:
        """Draft tokens (drawn exactly as the target's sampler would draw from q), their
        distributions q (when ``need_q``: one-hot on greedy rows), the network's probability
        of each drafted token (for greedy rows: under its unscaled softmax; 1 without a
        threshold, siblings or ``need_chosen``), and for the rows ``likeliest`` sibling
        candidates with their probabilities: on greedy and seeded rows the network's
        ``tree_width`` likeliest tokens (unscaled softmax), on unseeded random rows
        ``tree_width - 1`` further draws from q without replacement (the drafted token
        excluded), in draw order, with q at each."""
        t = SamplingTensors.build(rows, logits.shape[1], logits.device)
        q = target_probs(logits, t) if need_q or not t.all_greedy else None
        drafted = greedy_tokens(logits, t) if q is None else sample_rows(q, rows, t, self.generator)
        if not (self.confidence_threshold or likeliest or need_chosen):
            return drafted.tolist(), q, [1.0] * len(rows), {}
        chosen = None if q is None else q.gather(1, drafted[:, None])[:, 0]
        natural = None
        if t.any_greedy or likeliest:  # q is one-hot on greedy rows: the softmax's instead
            natural = torch.softmax(apply_penalties(logits.float(), t), dim=-1)
            at = natural.gather(1, drafted[:, None])[:, 0]
            chosen = at if chosen is None else torch.where(t.greedy, at, chosen)
        assert chosen is not None
        top: dict[int, list[tuple[float, int]]] = {}
        ranked = [row for row in likeliest if not samples_unseeded(rows[row].params)]
        if ranked:
            assert natural is not None
            index = torch.tensor(ranked, dtype=torch.long, device=logits.device)
            values, ids = natural.index_select(0, index).topk(self.tree_width, dim=-1)
            for row, v, i in zip(ranked, values.tolist(), ids.tolist(), strict=True):
                top[row] = list(zip(v, i, strict=True))
        for row in likeliest:
            if row not in top:  # an unseeded row: siblings drawn from q, without replacement
                assert q is not None
                top[row] = self._draws(q[row], int(drafted[row]))
        return drafted.tolist(), q, chosen.tolist(), top

    def _draws(self, q: torch.Tensor, drafted: int) -> list[tuple[float, int]]:
        """Up to ``tree_width - 1`` draws from ``q`` without ``drafted`` and without
        replacement, in draw order, with q at each."""
        rest = q.clone()
        rest[drafted] = 0.0
        count = min(self.tree_width - 1, int((rest > 0).sum()))
        if count == 0:
            return []
        ids = torch.multinomial(rest, count, replacement=False, generator=self.generator)
        return list(zip(q[ids].tolist(), ids.tolist(), strict=True))

    def catch_up(self, seq: Sequence) -> int:
        """Rows the network computes for ``seq`` before its first draft: 1 or 2 after a
        verify, more after steps it was skipped, the whole prompt for a new sequence."""
        return seq.num_tokens - self._computed.get(seq.seq_id, 0)

    def on_verified(self, seq: Sequence) -> None:
        held = self._computed.get(seq.seq_id)
        if held is None:
            return
        held = min(held, seq.num_computed_tokens)
        chain = self._chains.pop(seq.seq_id, None)
        if chain is not None:  # the cache holds the chain: valid where the target agreed
            first, drafted = chain
            agreed = 0
            emitted = seq.token_ids[first : first + len(drafted)]
            while self.net.keeps_drafts and agreed < len(emitted):
                if emitted[agreed] != drafted[agreed]:
                    break
                agreed += 1
            held = min(held, first + agreed)
        self._computed[seq.seq_id] = held

    def forget(self, seq: Sequence) -> None:
        self._computed.pop(seq.seq_id, None)
        self._chains.pop(seq.seq_id, None)
        self.net.forget(seq)


class _Chains:
    """One chain drafting call's per-request state: drafts, their q rows, the network's
    probability that each chain so far is right, and candidate siblings."""

    def __init__(self, requests: list[DraftRequest], branching: set[int]) -> None:
        self.requests = requests
        self.branching = branching
        count = len(requests)
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.probs: list[list[torch.Tensor]] = [[] for _ in range(count)]
        self.confidence = [1.0] * count  # the network's P(every draft so far is accepted)
        # q for every draft once any row samples: the verify needs a row per draft token
        self.keep_probs = any(not r.seq.params.greedy for r in requests)
        # (score, chain index, token) of each request's possible siblings
        self.siblings: list[list[tuple[float, int, int]]] = [[] for _ in range(count)]
        # first drafts priced (not an unseeded row's with siblings: those are further draws
        # from the unrestricted q)
        self.priced = {
            i
            for i, r in enumerate(requests)
            if r.row_price > 0.0 and not (i in branching and samples_unseeded(r.seq.params))
        }

    def take(
        self,
        step: int,
        active: list[int],
        drafted: list[int],
        q: torch.Tensor | None,
        chosen: list[float],
        likeliest: dict[int, list[tuple[float, int]]],
    ) -> set[int]:
        """Draft ``step``'s tokens of the ``active`` requests, one per row; the requests whose
        priced first draft is not worth its row (they get no drafts)."""
        dropped = set()
        for row, i in enumerate(active):
            if step == 0 and i in self.priced:
                price = self.requests[i].row_price
                if chosen[row] < price:  # not worth its verify row: no drafts this step
                    dropped.add(i)
                    self.branching.discard(i)
                    continue
                if q is not None and samples_unseeded(self.requests[i].seq.params):
                    q[row] = restricted(q[row], price)  # what a kept draft was drawn from
            for p, token in likeliest.get(row, ()):
                if token != drafted[row]:
                    self.siblings[i].append((self.confidence[i] * p, step, token))
            self.tokens[i].append(drafted[row])
            self.confidence[i] *= chosen[row]
            if q is not None:
                self.probs[i].append(q[row])
        return dropped

    def going_on(
        self, active: list[int], step: int, dropped: set[int], threshold: float
    ) -> list[int]:
        """The requests that draft past ``step``: not dropped, slots left, and confident."""
        return [
            i
            for i in active
            if i not in dropped
            and self.requests[i].max_drafts > step + 1
            and self.confidence[i] >= max(threshold, self.requests[i].row_price)
        ]

    def proposal(self) -> Proposal:
        """The chains, each with the siblings that pay where it may branch."""
        parents: list[list[int] | None] = [None] * len(self.requests)
        for i in self.branching:
            request = self.requests[i]
            drawn = samples_unseeded(request.seq.params)
            parents[i] = with_siblings(
                self.tokens[i], self.probs[i], self.siblings[i], request, drawn
            )
        draft_probs = None
        q_rows = [row for per_request in self.probs for row in per_request]
        if self.keep_probs and q_rows:  # (none when every first draft was dropped)
            draft_probs = torch.stack(q_rows)
        trees = parents if any(p is not None for p in parents) else None
        return Proposal(self.tokens, draft_probs, trees)


def samples_unseeded(params: SamplingParams) -> bool:
    return not params.greedy and params.seed is None


def restricted(q: torch.Tensor, floor: float) -> torch.Tensor:
    """``q`` given that the token drawn from it has a probability of at least ``floor``
    (renormalised over those tokens): the distribution a draft kept for reaching a price was
    drawn from, which the verifier must judge it by to stay exact (a dropped draft's
    position is sampled from the target alone, so the two cases mix back to the target's
    distribution)."""
    kept = torch.where(q >= floor, q, torch.zeros_like(q))
    return kept / kept.sum()
