"""A separate, smaller draft model with its own paged KV cache on the target's block tables.

The draft cache has the target's block ids and block size but its own tensors, so the target's
allocation (with its lookahead slots) governs both. Per sequence the proposer remembers how many
leading tokens its cache holds. A step first *catches up* on the tokens it has not seen (after a
verify: the last accepted draft and/or the correction token, 1-2 tokens; for a new sequence its
whole prompt) and draws the first draft from the last row; then it runs ``k - 1`` single-token
forwards, each one batched over every sequence that still wants drafts. With a confidence
threshold a sequence stops early, after the draft that brings the draft's probability that all
its drafts so far are right (the product of its probabilities of the tokens it drafted) below
it: one more would probably be rejected and cost a draft forward and a verify slot. (The draft
that crossed it is kept: its forward is paid, and a verify slot is cheap.) After
verification the valid prefix shrinks to the accepted tokens the cache holds
(``on_verified``): that is the draft's rollback.

Priced first drafts (under the goodput controller, where a verify row costs something: the
request's ``row_price``, in tokens): the first draft is made only if the draft's probability
of it reaches the price, and the chain goes on only while its probability that every draft so
far is right does too. The draft's probability of its likeliest token is close to the chance
the target agrees (the shipped draft on Spec-Bench answers, ``benchmarks/draft_bound.py``:
0.32 agreed at 0.3-0.4, 0.79 at 0.7-0.8), so this keeps the drafts that pay for their row
and spends only the forward on the rest (which the catch-up would pay anyway). On greedy and
seeded rows any rule is exact (the verifier matches the target's own token); on an unseeded
random row a kept first draft is judged by q restricted to the tokens that reach the price
(``_restricted``): what it was drawn from.

Trees (``siblings``, under the goodput controller): beside the chain a sequence may get *leaf*
siblings at each chain position, scored by the draft's probability that the chain up to there
is right times the sibling's probability. On greedy and seeded rows they are the draft's next
likeliest tokens (its top ``SIBLING_CANDIDATES`` after the chain's own), taken best first; on
unseeded random rows they are further draws from the same q without replacement (what the
recursive rejection sampler needs to stay exact), taken in draw order, each position's a
prefix that stops at the first draw that does not pay. They cost no draft forward (their
distributions were computed for the chain) and one verify row each, so they are added while
the score beats the request's ``node_price`` and slots remain. A sibling never enters the
draft's cache (the cache holds the chain's tokens at their positions): when the target
accepts one, the draft's valid prefix ends before it and the next step catches up on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from specbatch.cache.kv_tensors import allocate_kv_caches
from specbatch.kernels.sampling import (
    SamplingRow,
    SamplingTensors,
    apply_penalties,
    greedy_tokens,
    sample_rows,
    target_probs,
)
from specbatch.models.llama import LlamaForCausalLM
from specbatch.runner.flat_batch import TokenRun, flatten
from specbatch.runner.model_runner import ModelRunner
from specbatch.sampling_params import SamplingParams
from specbatch.sequence import Sequence
from specbatch.spec_decode.proposer import DraftRequest, Proposal, Proposer, with_point_masses

if TYPE_CHECKING:  # triton is optional: only CUDA engines build graphs (eagle imports this)
    from specbatch.runner.cuda_graphs import CudaGraphRunner
    from specbatch.spec_decode.eagle import EagleHead

MAX_FORWARD_TIMES = 64
SIBLING_CANDIDATES = 3  # per chain position, the likeliest tokens besides the chain's


class DraftModelProposer(Proposer):
    """Drafts with a small model, sampling each draft from its processed distribution q."""

    # where nodes beside the chain pay: EAGLE-2's dynamic tree (``_grow_trees``, a forward
    # per level) instead of siblings of the chain (no extra forward)
    dynamic_trees = False

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        generator: torch.Generator,
        confidence_threshold: float = 0.0,
        capture_graphs: Callable[[], CudaGraphRunner | None] | None = None,
        siblings: bool = False,
    ) -> None:
        """``capture_graphs`` builds CUDA graphs for the single-token draft forwards; it is
        called once the draft's KV cache is bound (graphs capture the cache's addresses)."""
        self.model = model
        self._init_state(model, num_blocks, block_size, generator, confidence_threshold, siblings)
        self.runner = ModelRunner(model, block_size, capture_graphs() if capture_graphs else None)

    def _init_state(
        self,
        drafter: LlamaForCausalLM | EagleHead,
        num_blocks: int,
        block_size: int,
        generator: torch.Generator,
        confidence_threshold: float,
        siblings: bool,
    ) -> None:
        """What every drafting network shares: its own paged K/V on the target's block ids
        (allocated and bound here) and the per-sequence bookkeeping."""
        self.confidence_threshold = confidence_threshold
        self.block_size = block_size
        self.generator = generator
        self.siblings = siblings
        config = drafter.config
        drafter.bind_kv_caches(
            allocate_kv_caches(config, num_blocks, block_size, drafter.dtype, drafter.device)
        )
        self._computed: dict[int, int] = {}  # seq_id -> leading tokens held by the draft cache
        # seq_id -> (position of the first draft, the chain): what the cache holds past the
        # sequence's tokens, checked against what the target accepted
        self._chains: dict[int, tuple[int, list[int]]] = {}
        self.num_forwards = 0  # batched draft forwards run so far (for cost accounting)
        self._forward_times: list[tuple[int, float]] = []  # (rows, seconds) not yet taken

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """With ``dynamic_trees``, a dynamic tree (``_grow_trees``) for the requests whose
        price lets nodes beside the chain pay; a chain (with siblings where they pay, if not
        ``dynamic_trees``) for the others."""
        growing = [i for i, r in enumerate(requests) if self._grows_tree(r)]
        if not growing:
            return self._chain_proposal(requests)
        chains = [i for i, r in enumerate(requests) if not self._grows_tree(r)]
        tokens: list[list[int]] = [[] for _ in requests]
        parents: list[list[int] | None] = [None] * len(requests)
        q_rows: dict[int, torch.Tensor] = {}  # request -> q of its drafts (chains that sample)
        if chains:
            chained = self._chain_proposal([requests[i] for i in chains])
            row = 0
            for s, i in enumerate(chains):
                tokens[i], parents[i] = chained.tokens[s], chained.parents_of(s)
                if chained.draft_probs is not None:
                    q_rows[i] = chained.draft_probs[row : row + len(tokens[i])]
                row += len(chained.tokens[s])
        grown = self._grow_trees([requests[i] for i in growing])
        for i, (nodes, links) in zip(growing, grown, strict=True):
            tokens[i], parents[i] = nodes, links
        trees = parents if any(p is not None for p in parents) else None
        if not q_rows:
            return Proposal(tokens, None, trees)
        # a grown tree's nodes are point masses
        sampled = sorted(q_rows)
        probs = with_point_masses(tokens, sampled, torch.cat([q_rows[i] for i in sampled]))
        return Proposal(tokens, probs, trees)

    def _grows_tree(self, r: DraftRequest) -> bool:
        return self.dynamic_trees and self._may_branch(r)

    def _chain_proposal(self, requests: list[DraftRequest]) -> Proposal:
        """Each request's chain: drafts one batched forward per position, with siblings where
        ``_may_branch``."""
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        runs = []
        for r in requests:
            start = self._computed.get(r.seq.seq_id, 0)
            runs.append(TokenRun(r.seq.token_ids[start:], start, r.seq.block_table))
        active = list(range(len(requests)))
        confidence = [1.0] * len(requests)  # the draft's P(every draft so far is accepted)
        # q for every draft once any row samples: the verify needs a row per draft token
        keep_probs = any(not r.seq.params.greedy for r in requests)
        # (score, chain index, token) of each request's possible siblings
        siblings: list[list[tuple[float, int, int]]] = [[] for _ in requests]
        branching = {i for i, r in enumerate(requests) if self._may_branch(r)}
        # first drafts priced (not an unseeded row's with siblings: those are further draws
        # from the unrestricted q)
        priced = {
            i
            for i, r in enumerate(requests)
            if r.row_price > 0.0 and not (i in branching and _samples_unseeded(r.seq.params))
        }
        for step in range(max(r.max_drafts for r in requests)):
            started = time.perf_counter()
            logits = self._draft_logits(runs, [requests[i].seq for i in active], step)
            self.num_forwards += 1
            num_rows = sum(len(run.token_ids) for run in runs)
            for i, run in zip(active, runs, strict=True):
                self._computed[requests[i].seq.seq_id] = run.start_position + len(run.token_ids)
            rows = [requests[i].seq.sampling_row(tokens[i]) for i in active]
            want = [row for row, i in enumerate(active) if i in branching]
            drafted, q, chosen, likeliest = self._sample(
                logits, rows, keep_probs, want, need_chosen=bool(priced)
            )
            dropped = set()
            for row, i in enumerate(active):
                if step == 0 and i in priced:
                    price = requests[i].row_price
                    if chosen[row] < price:  # not worth its verify row: no drafts this step
                        dropped.add(i)
                        branching.discard(i)
                        continue
                    if q is not None and _samples_unseeded(requests[i].seq.params):
                        q[row] = _restricted(q[row], price)  # what a kept draft was drawn from
                for p, token in likeliest.get(row, ()):
                    if token != drafted[row]:
                        siblings[i].append((confidence[i] * p, step, token))
                tokens[i].append(drafted[row])
                confidence[i] *= chosen[row]
                if q is not None:
                    probs[i].append(q[row])
            self._forward_times.append((num_rows, time.perf_counter() - started))
            del self._forward_times[:-MAX_FORWARD_TIMES]  # nobody may be taking them
            active = [
                i
                for i in active
                if i not in dropped
                and requests[i].max_drafts > step + 1
                and confidence[i] >= max(self.confidence_threshold, requests[i].row_price)
            ]
            runs = [
                TokenRun(
                    [tokens[i][-1]], requests[i].seq.num_tokens + step, requests[i].seq.block_table
                )
                for i in active
            ]
            if not active:
                break
        for r, chain in zip(requests, tokens, strict=True):
            self._chains[r.seq.seq_id] = (r.seq.num_tokens, list(chain))
        parents: list[list[int] | None] = [None] * len(requests)
        for i in branching:
            drawn = _samples_unseeded(requests[i].seq.params)
            parents[i] = _with_siblings(tokens[i], probs[i], siblings[i], requests[i], drawn)
        draft_probs = None
        q_rows = [row for per_request in probs for row in per_request]
        if keep_probs and q_rows:  # (none when every first draft was dropped)
            draft_probs = torch.stack(q_rows)
        trees = parents if any(p is not None for p in parents) else None
        return Proposal(tokens, draft_probs, trees)

    def _grow_trees(self, requests: list[DraftRequest]) -> list[tuple[list[int], list[int]]]:
        """EAGLE-2's dynamic draft tree per request: from the draft's distribution after the
        catch-up, each level expands the likeliest nodes (by path probability: the product
        of the draft's probabilities along the path) into their ``TREE_CHILDREN`` likeliest
        children, one batched draft forward per level over every sequence's tree so far
        (under its tree mask); then the nodes kept are the chain of likeliest tokens while its
        path probability stays above the confidence threshold, plus every other node whose
        path probability beats the request's ``node_price``, best first, up to
        ``max_nodes`` (a node's ancestors always rank before it). Each node is a point mass
        (exact under every sampling mode: the verifier's residual drops a rejected one)."""
        started = time.perf_counter()
        seqs = [r.seq for r in requests]
        runs = []
        for r in requests:
            start = self._computed.get(r.seq.seq_id, 0)
            runs.append(TokenRun(r.seq.token_ids[start:], start, r.seq.block_table))
        logits = self._draft_logits(runs, seqs, 0)
        self.num_forwards += 1
        num_rows = sum(len(run.token_ids) for run in runs)
        trees = [GrowingTree(r) for r in requests]
        for tree, row in zip(trees, torch.softmax(logits.float(), dim=-1), strict=True):
            tree.add_children(-1, row, self.confidence_threshold)
        for seq in seqs:
            self._computed[seq.seq_id] = seq.num_tokens
        self._forward_times.append((num_rows, time.perf_counter() - started))
        depth = 1
        while True:
            expanding = [(i, t.to_expand(depth)) for i, t in enumerate(trees)]
            expanding = [(i, nodes) for i, nodes in expanding if nodes]
            if not expanding:
                break
            started = time.perf_counter()
            level_runs, levels, rows = [], [], []
            for i, nodes in expanding:
                tree, seq = trees[i], seqs[i]
                tree.expanded.update(nodes)
                order = tree.run_order()
                parents = [
                    order.index(tree.parent[n]) if tree.parent[n] >= 0 else -1 for n in order
                ]
                level_runs.append(
                    TokenRun(
                        [seq.token_ids[-1], *(tree.token[n] for n in order)],
                        seq.num_tokens - 1,
                        seq.block_table,
                        len(order),
                        0,
                        parents,
                    )
                )
                levels.append((tree, seq, order))
                rows.append([order.index(n) + 1 for n in nodes])
            logits = self._level_logits(level_runs, levels, rows)
            owners = [(i, n) for i, nodes in expanding for n in nodes]
            probs = torch.softmax(logits, dim=-1)
            for (i, n), row in zip(owners, probs, strict=True):
                trees[i].add_children(n, row, self.confidence_threshold)
            self.num_forwards += 1
            num_rows = sum(len(run.token_ids) for run in level_runs)
            self._forward_times.append((num_rows, time.perf_counter() - started))
            del self._forward_times[:-MAX_FORWARD_TIMES]
            depth += 1
        out = []
        for tree, seq in zip(trees, seqs, strict=True):
            nodes, links = tree.kept()
            self._chains[seq.seq_id] = (seq.num_tokens, [])  # the cache holds nothing past
            out.append((nodes, links))
        return out

    def _level_logits(
        self,
        runs: list[TokenRun],
        levels: list[tuple[GrowingTree, Sequence, list[int]]],
        wanted: list[list[int]],
    ) -> torch.Tensor:
        """Logits over the target vocabulary at each run's ``wanted`` rows (run-relative), in
        order: one forward over every sequence's tree so far (``levels``: its tree, sequence
        and the expanded nodes in run order), each under its tree mask."""
        batch = flatten(runs, self.block_size)
        rows = np.concatenate(
            [batch.query_start[b] + np.asarray(w, dtype=np.int64) for b, w in enumerate(wanted)]
        )
        return self.model.logits_in_output_vocab(self.runner.forward(batch, rows))

    def _draft_logits(self, runs: list[TokenRun], seqs: list[Sequence], step: int) -> torch.Tensor:
        """Logits over the target vocabulary at the last row of each run (one run per
        sequence of ``seqs``; ``step`` 0 is the catch-up, then one draft token each)."""
        batch = flatten(runs, self.block_size)
        last_rows = batch.query_start[1:] - 1
        return self.model.logits_in_output_vocab(self.runner.forward(batch, last_rows))

    def _may_branch(self, r: DraftRequest) -> bool:
        return self.siblings and r.max_nodes > r.max_drafts and r.node_price < 1.0

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        need_q: bool,
        likeliest: list[int],
        need_chosen: bool = False,
    ) -> tuple[list[int], torch.Tensor | None, list[float], dict[int, list[tuple[float, int]]]]:
        """Draft tokens (drawn exactly as the target's sampler would draw from q), their
        distributions q (when ``need_q``: one-hot on greedy rows), the draft's probability of
        each drafted token (for greedy rows: under its unscaled softmax; 1 without a threshold,
        siblings or ``need_chosen``), and for the rows ``likeliest`` sibling candidates with their
        probabilities: on greedy and seeded rows the draft's ``SIBLING_CANDIDATES + 1``
        likeliest tokens (unscaled softmax), on unseeded random rows ``SIBLING_CANDIDATES``
        further draws from q without replacement (the drafted token excluded), in draw order,
        with q at each."""
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
        ranked = [row for row in likeliest if not _samples_unseeded(rows[row].params)]
        if ranked:
            assert natural is not None
            index = torch.tensor(ranked, dtype=torch.long, device=logits.device)
            values, ids = natural.index_select(0, index).topk(SIBLING_CANDIDATES + 1, dim=-1)
            for row, v, i in zip(ranked, values.tolist(), ids.tolist(), strict=True):
                top[row] = list(zip(v, i, strict=True))
        for row in likeliest:
            if row not in top:  # an unseeded row: siblings drawn from q, without replacement
                assert q is not None
                top[row] = self._draws(q[row], int(drafted[row]))
        return drafted.tolist(), q, chosen.tolist(), top

    def _draws(self, q: torch.Tensor, drafted: int) -> list[tuple[float, int]]:
        """Up to ``SIBLING_CANDIDATES`` draws from ``q`` without ``drafted`` and without
        replacement, in draw order, with q at each."""
        rest = q.clone()
        rest[drafted] = 0.0
        count = min(SIBLING_CANDIDATES, int((rest > 0).sum()))
        if count == 0:
            return []
        ids = torch.multinomial(rest, count, replacement=False, generator=self.generator)
        return list(zip(q[ids].tolist(), ids.tolist(), strict=True))

    def catch_up(self, seq: Sequence) -> int:
        """Rows the draft computes for ``seq`` before its first draft: 1 or 2 after a
        verify, more after steps it was skipped, the whole prompt for a new sequence."""
        return seq.num_tokens - self._computed.get(seq.seq_id, 0)

    def take_forward_times(self) -> list[tuple[int, float]]:
        """(rows, seconds) of every draft forward since the last call (sampling included)."""
        times, self._forward_times = self._forward_times, []
        return times

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
            while agreed < len(emitted) and emitted[agreed] == drafted[agreed]:
                agreed += 1
            held = min(held, first + agreed)
        self._computed[seq.seq_id] = held

    def forget(self, seq: Sequence) -> None:
        self._computed.pop(seq.seq_id, None)
        self._chains.pop(seq.seq_id, None)


def _samples_unseeded(params: SamplingParams) -> bool:
    return not params.greedy and params.seed is None


def _restricted(q: torch.Tensor, floor: float) -> torch.Tensor:
    """``q`` given that the token drawn from it has a probability of at least ``floor``
    (renormalised over those tokens): the distribution a draft kept for reaching a price was
    drawn from, which the verifier must judge it by to stay exact (a dropped draft's
    position is sampled from the target alone, so the two cases mix back to the target's
    distribution)."""
    kept = torch.where(q >= floor, q, torch.zeros_like(q))
    return kept / kept.sum()


TREE_CHILDREN = 4  # children per expanded node
TREE_EXPAND = 3  # nodes expanded per level (besides the chain's)


class GrowingTree:
    """A request's growing draft tree (``DraftModelProposer._grow_trees``): candidate nodes
    with their path probabilities."""

    def __init__(self, request: DraftRequest) -> None:
        self.request = request
        self.token: list[int] = []
        self.parent: list[int] = []
        self.score: list[float] = []  # the head's probability of the path to the node
        self.depth: list[int] = []
        self.chain: list[int] = []  # the likeliest path while confident
        self.expanded: set[int] = set()
        self.out: dict[int, torch.Tensor] = {}  # expanded node -> a head's output feature

    def add_children(self, parent: int, probs: torch.Tensor, threshold: float) -> None:
        depth = 1 if parent < 0 else self.depth[parent] + 1
        if depth > self.request.max_drafts:
            return
        base = 1.0 if parent < 0 else self.score[parent]
        values, ids = probs.topk(TREE_CHILDREN)
        for rank, (p, token) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
            if p <= 0.0:
                break
            self.token.append(token)
            self.parent.append(parent)
            self.score.append(base * p)
            self.depth.append(depth)
            on_chain = rank == 0 and (parent < 0 or self.chain[-1:] == [parent])
            if on_chain and (depth == 1 or self.score[self.chain[-1]] >= threshold):
                self.chain.append(len(self.token) - 1)

    def to_expand(self, depth: int) -> list[int]:
        """The nodes of ``depth`` whose children are worth a look: the chain's, and the
        likeliest others whose path probability beats the node price."""
        # the expanded nodes are written to the sequence's draft slots: never more than it has
        room = max(self.request.max_nodes, self.request.max_drafts) - len(self.expanded)
        if depth >= self.request.max_drafts or room <= 0:
            return []
        level = [n for n in range(len(self.token)) if self.depth[n] == depth]
        chosen = [n for n in level if n in self.chain]
        others = sorted(
            (n for n in level if n not in chosen and self.score[n] > self.request.node_price),
            key=lambda n: -self.score[n],
        )
        return (chosen + others[:TREE_EXPAND])[:room]

    def run_order(self) -> list[int]:
        """The expanded nodes in creation order (parents before children)."""
        return sorted(self.expanded)

    def kept(self) -> tuple[list[int], list[int]]:
        """The tree to verify: tokens and parents (indices into it), nodes in rank order."""
        room = max(self.request.max_nodes, self.request.max_drafts)
        keep = list(self.chain)
        others = sorted(
            (n for n in range(len(self.token)) if n not in set(keep)),
            key=lambda n: (-self.score[n], n),
        )
        chosen = set(keep)
        for n in others:
            if len(keep) >= room or self.score[n] <= self.request.node_price:
                break
            if self.parent[n] < 0 or self.parent[n] in chosen:
                keep.append(n)
                chosen.add(n)
        keep.sort()  # creation order: parents first
        index = {n: i for i, n in enumerate(keep)}
        return [self.token[n] for n in keep], [
            -1 if self.parent[n] < 0 else index[self.parent[n]] for n in keep
        ]


def _with_siblings(
    chain: list[int],
    q_rows: list[torch.Tensor],
    candidates: list[tuple[float, int, int]],
    request: DraftRequest,
    drawn: bool = False,
) -> list[int] | None:
    """Add to ``chain`` (in place, with q rows) the siblings that beat the request's node
    price, within its slots; the tree's parents, or None when none paid.

    Ranked candidates (greedy, seeded) are taken best first. ``drawn`` ones (an unseeded
    row's draws without replacement, in draw order) are taken position by position as a
    prefix of each position's draws, stopping at the first that does not pay: the verifier's
    exactness needs a node's children to be successive draws from q, which dropping or
    reordering by value would break."""
    room = max(request.max_nodes - len(chain), 0)
    usable = [c for c in candidates if c[1] < len(chain)]
    if drawn:
        paying: list[tuple[float, int, int]] = []
        stopped: set[int] = set()
        for c in usable:  # in draw order within each position
            if c[1] in stopped or len(paying) == room:
                continue
            if c[0] > request.node_price:
                paying.append(c)
            else:
                stopped.add(c[1])
    else:
        paying = sorted((c for c in usable if c[0] > request.node_price), key=lambda c: -c[0])
        paying = paying[:room]
    if not paying:
        return None
    parents = list(range(-1, len(chain) - 1))
    for _, index, token in paying:
        chain.append(token)
        parents.append(index - 1)  # beside chain draft ``index``: under the same parent
        if q_rows:  # what it was drawn from (not read on greedy or seeded rows)
            q_rows.append(q_rows[index])
    return parents
