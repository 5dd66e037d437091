"""A drafting network's trees: leaf siblings beside its chain, and EAGLE-2's dynamic trees.

Siblings (``with_siblings``): beside the chain a sequence may get *leaf* siblings at each chain
position, scored by the network's probability that the chain up to there is right times the
sibling's probability. On greedy and seeded rows they are the network's next likeliest tokens
(its top ``width - 1`` after the chain's own), taken best first; on unseeded random
rows they are further draws from the same q without replacement (what the recursive
rejection sampler needs to stay exact), taken in draw order, each position's a prefix that
stops at the first draw that does not pay. They cost no forward (their distributions were
computed for the chain) and one verify row each, so they are added while the score beats the
request's ``node_price`` and slots remain. A sibling never enters the network's cache (which
holds the chain's tokens at their positions): when the target accepts one, the valid prefix
ends before it and the next step catches up on it.

Dynamic trees (``GrowingTree``): each level expands the likeliest nodes (by path probability,
the product of the network's probabilities along the path: the chain's node and ``width - 1``
others) into their ``width`` likeliest children, one forward per level; the nodes kept are the
chain of likeliest tokens while its path probability stays above the confidence threshold,
plus every other node whose path probability beats the request's ``node_price``, best first,
up to its slots (a node's ancestors always rank before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.runner.flat_batch import TokenRun
from specbatch.sequence import Sequence
from specbatch.spec_decode.proposers.base import DraftRequest


@dataclass(frozen=True)
class TreeLevel:
    """One sequence's tree in a level's forward: ``run`` holds the sequence's last token and
    the ``order``ed expanded nodes (parents first), ``wanted`` the run rows (1 + index in
    ``order``) of the nodes expanded now, whose children the level's logits give."""

    tree: GrowingTree
    seq: Sequence
    order: list[int]
    run: TokenRun
    wanted: list[int]


class GrowingTree:
    """A request's growing draft tree: candidate nodes with their path probabilities."""

    def __init__(self, request: DraftRequest, width: int) -> None:
        self.request = request
        self.width = width
        self.token: list[int] = []
        self.parent: list[int] = []
        self.score: list[float] = []  # the network's probability of the path to the node
        self.depth: list[int] = []
        self.chain: list[int] = []  # the likeliest path while confident
        self.expanded: set[int] = set()
        self.out: dict[int, torch.Tensor] = {}  # expanded node -> a head's output feature

    def add_children(self, parent: int, probs: torch.Tensor, threshold: float) -> None:
        depth = 1 if parent < 0 else self.depth[parent] + 1
        if depth > self.request.max_drafts:
            return
        base = 1.0 if parent < 0 else self.score[parent]
        values, ids = probs.topk(self.width)
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
        room = self.request.slots - len(self.expanded)
        if depth >= self.request.max_drafts or room <= 0:
            return []
        level = [n for n in range(len(self.token)) if self.depth[n] == depth]
        chosen = [n for n in level if n in self.chain]
        others = sorted(
            (n for n in level if n not in chosen and self.score[n] > self.request.node_price),
            key=lambda n: -self.score[n],
        )
        return (chosen + others[: self.width - 1])[:room]

    def level(self, seq: Sequence, nodes: list[int]) -> TreeLevel:
        """Expand ``nodes``: the sequence's run of every expanded node so far (creation order,
        parents before children) under its tree mask."""
        self.expanded.update(nodes)
        order = sorted(self.expanded)
        parents = [order.index(self.parent[n]) if self.parent[n] >= 0 else -1 for n in order]
        run = TokenRun(
            [seq.token_ids[-1], *(self.token[n] for n in order)],
            seq.num_tokens - 1,
            seq.block_table,
            len(order),
            0,
            parents,
        )
        return TreeLevel(self, seq, order, run, [order.index(n) + 1 for n in nodes])

    def kept(self) -> tuple[list[int], list[int]]:
        """The tree to verify: tokens and parents (indices into it), nodes in rank order."""
        room = self.request.slots
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


def with_siblings(
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
