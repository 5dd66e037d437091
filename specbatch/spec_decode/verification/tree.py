"""Tree verification (SpecInfer, EAGLE-2): which path of a draft tree survives, batched.

Each sequence proposes a :class:`DraftTree`; the target gives ``1 + len(tree)`` rows per sequence:
row 0 is the distribution of the token after the root (the sequence's last token), row ``1 + i``
that of the token after node i's path (penalties see the path as history). Rows are processed
exactly as the plain sampler would (``target_probs``). The walk starts at the root; at the
current node, with p its row, the children are looked at in node order:

* **greedy rows** accept the child equal to the argmax, else stop and emit the argmax;
* **seeded rows** accept the child equal to the target's own Gumbel-max sample at this position
  (``gumbel_noise(seed, position)``), else stop and emit it: every emitted token is the target's
  own seeded sample, so the output never depends on the tree;
* **unseeded random rows** use recursive rejection sampling over the siblings (Jeon et al. 2024;
  SpecInfer's multi-step speculative sampling). With ``p_cur = p``, for each child c_i in turn:
  with q (siblings drawn from q without replacement) ``q_cur`` is q without the earlier, rejected
  siblings, renormalised; c_i is accepted with probability ``min(1, p_cur(c_i) / q_cur(c_i))``,
  and a rejection sets ``p_cur = norm(max(0, p_cur - q_cur))``. A child without q (a point
  mass: a prompt-lookup token, a top-k child) is accepted with probability
  ``p_cur(c_i) / sum(p_cur)`` and a rejection zeroes ``p_cur(c_i)``. An accepted child becomes
  the current node; when none is, the final token is drawn from ``p_cur``.

Why the output is exactly p (induction on the number m of children left, for *any* target
p_cur and proposal). With none, the token is drawn from p_cur. Otherwise, given the earlier
siblings, c ~ q_cur (this is what drawing without replacement means; a deterministic proposal is
q_cur = one-hot(c)), and the step is the rejection sampler of Leviathan et al.:
``P(accept c = x) = min(p_cur(x), q_cur(x))`` and a rejection has probability
``1 - sum min(p_cur, q_cur) = sum max(0, p_cur - q_cur)``. Whatever c was, after a rejection the
remaining siblings are draws without replacement from q_cur without c, independent of the
uniform that rejected c, and r = ``norm(max(0, p_cur - q_cur))`` does not depend on c: by
induction the rest of the procedure outputs exactly r. In total
``min(p_cur, q_cur)(x) + max(0, p_cur - q_cur)(x) = p_cur(x)``. (r is 0 at every rejected
token, so no rejected sibling comes back.) An accepted child's own children were drawn given its
path only, so the next token is again exactly the target's, and the emitted tokens follow the
target's joint distribution. When ``max(0, p_cur - q_cur)`` is empty (p_cur == q_cur up to
rounding: the rejection had probability 0), p_cur is kept, as the chain verifier does.

Target rows and q rows are taken as distributions as they come (mass 1: a float32 softmax sums
to 1 only up to ~1e-7), as the chain verifier does. A chain of k drafts is the tree with parents
``[-1, 0, .., k - 2]``, and on it this is the chain verifier of
:mod:`specbatch.spec_decode.verification.chain`, uniform for uniform (its residual is float32,
this one's float64: the final tokens could part only on a uniform within ~1e-7 of a CDF
boundary).

Batching: padded ``[S, n_max + 1]`` tensors over node *slots* (slot 0 the root, slot ``1 + i``
node i); Python iterates over depths and sibling ranks, never over sequences. A node's first
child is tested with scalars only (p and q at its token); ``[n, V]`` float64 residuals are
computed at a depth only for the unseeded sequences with a node of several children there (and
kept for the final draw of those that stop there), and once per unseeded sequence for the final
draw, as in the chain verifier. One device-to-host transfer at the end. Every sequence draws
``n_max + 1`` float64 uniforms from the generator in one ``torch.rand`` call when any sequence is
unseeded random: column i decides node i (each node is tested at most once), column ``n_max``
the final token.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field

import numpy as np
import torch

from specbatch.kernels.sampling import (
    SamplingRow,
    SamplingTensors,
    greedy_tokens,
    inverse_cdf,
    row_argmax,
    target_probs,
    with_seeded_samples,
)
from specbatch.sequence import Sequence


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One sequence's drafts: node i proposes ``tokens[i]`` after node ``parents[i]``'s path.

    ``parents[i]`` is -1 for a child of the root (the sequence's last token) and otherwise an
    earlier node (topological order). ``draft_probs`` has one row per node, the distribution
    q its token was drawn from at its parent (siblings share it: they were drawn without
    replacement); None makes every node a point mass (a deterministic proposal).
    """

    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        seen: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} is not -1 or an earlier node")
            if (parent, token) in seen:
                raise ValueError(f"node {i}: token {token} repeats a sibling's")
            seen.add((parent, token))
        q = self.draft_probs
        if q is not None and (q.dim() != 2 or q.shape[0] != len(self.tokens)):
            raise ValueError(f"draft_probs {tuple(q.shape)}: need one row per node")

    @classmethod
    def chain(cls, tokens: SequenceT[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
        """k drafts one after the other."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), draft_probs)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each node's depth (1 for a child of the root)."""
        return node_depths(self.parents)

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``, root-most first."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]


def node_depths(parents: SequenceT[int]) -> list[int]:
    """Each node's depth (1 for a child of the root) from a topological parent array."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def tree_rows(seq: Sequence, tree: DraftTree) -> list[SamplingRow]:
    """The ``1 + len(tree)`` sampling rows of a sequence's tree, in :func:`verify_tree`'s order."""
    return [seq.sampling_row()] + [seq.sampling_row(tree.path_tokens(i)) for i in range(len(tree))]


@dataclass
class TreeVerifyResult:
    num_accepted: list[int]  # drafts accepted per sequence (the accepted path's length)
    tokens: list[list[int]]  # the accepted path's tokens plus the correction or bonus token
    accepted_nodes: list[list[int]]  # node indices of the accepted path, root-most first


@dataclass
class _Layout:
    """Every sequence's tree as padded tensors over slots (0: the root, 1 + i: node i).

    Padding slots point at the sequence's last row and have no children.
    """

    rows: torch.Tensor  # [S, n_max + 1] target row of each slot
    tokens: torch.Tensor  # [S, n_max + 1] each slot's token, 0 at the root and past the tree
    children: torch.Tensor  # [S, n_max + 1, c_max] children's slots in node order, 0 past them
    widths: list[int]  # per depth d (the root's is 0): most children of any depth-d slot
    branching: list[list[int]]  # per depth d: sequences with a depth-d slot of >= 2 children
    first_rows: list[int]  # each sequence's row 0
    n_max: int

    @classmethod
    def of(cls, trees: SequenceT[DraftTree], device: torch.device) -> _Layout:
        sizes = [len(t) for t in trees]
        n_max = max(sizes, default=0)
        starts = np.cumsum([0, *(n + 1 for n in sizes)])[:-1]
        slot = np.arange(n_max + 1)
        rows = starts[:, None] + np.minimum(slot[None, :], np.asarray(sizes)[:, None])
        tokens = np.zeros((len(trees), n_max + 1), dtype=np.int64)
        # (sequence, parent slot, rank among its siblings, child slot) of every node
        edges: list[tuple[int, int, int, int]] = []
        widths: list[int] = []
        branching: list[set[int]] = []
        for s, tree in enumerate(trees):
            tokens[s, 1 : len(tree) + 1] = tree.tokens
            counts = [0] * (len(tree) + 1)
            depths = [0, *tree.depths()]
            for i, parent in enumerate(tree.parents):
                edges.append((s, parent + 1, counts[parent + 1], i + 1))
                counts[parent + 1] += 1
            for parent_slot, count in enumerate(counts):
                _widen(widths, branching, depths[parent_slot], count, s)
        c_max = max(widths, default=0)
        children = np.zeros((len(trees), n_max + 1, max(c_max, 1)), dtype=np.int64)
        if edges:
            s_, parent_, rank_, child_ = np.asarray(edges).T
            children[s_, parent_, rank_] = child_
        return cls(
            torch.from_numpy(rows.astype(np.int64)).to(device),
            torch.from_numpy(tokens).to(device),
            torch.from_numpy(children).to(device),
            widths[: _deepest_parent(widths) + 1],
            [sorted(b) for b in branching],
            [int(x) for x in starts],
            n_max,
        )

    def row_of(self, slots: torch.Tensor, seqs: torch.Tensor | None = None) -> torch.Tensor:
        """The target row of each sequence's slot (of sequences ``seqs``, or all)."""
        rows = self.rows if seqs is None else self.rows[seqs]
        return rows.gather(1, slots[:, None])[:, 0]

    def children_of(self, slots: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
        return self.children[seqs, slots]

    def tokens_of(self, slots: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
        return self.tokens[seqs].gather(1, slots)


def _widen(widths: list[int], branching: list[set[int]], depth: int, count: int, s: int) -> None:
    """Record that sequence s has a depth-``depth`` slot with ``count`` children."""
    while len(widths) <= depth:
        widths.append(0)
        branching.append(set())
    widths[depth] = max(widths[depth], count)
    if count >= 2:
        branching[depth].add(s)


def _deepest_parent(widths: list[int]) -> int:
    """The deepest depth with children anywhere (-1: every tree is empty)."""
    return max((d for d, w in enumerate(widths) if w), default=-1)


@dataclass
class _Drafts:
    """The draft distributions of the trees that have them, one row per node."""

    probs: torch.Tensor  # [N_q, V]: every tree with q, concatenated
    index: torch.Tensor  # [S, n_max + 1] row of each slot in ``probs`` (0 where meaningless)
    has_q: torch.Tensor  # [S] bool
    at_token: torch.Tensor  # [S, n_max + 1] float64 q(token) of each slot, 1 for point masses
    all_q: bool  # every tree with nodes has q (no point-mass residuals to compute)

    @classmethod
    def of(
        cls, trees: SequenceT[DraftTree], layout: _Layout, device: torch.device
    ) -> _Drafts | None:
        with_q = [s for s, t in enumerate(trees) if t.draft_probs is not None and len(t)]
        if not with_q:
            return None
        probs = _concatenated([_q(trees[s]) for s in with_q]).to(device)
        index = np.zeros((len(trees), layout.n_max + 1), dtype=np.int64)
        is_q = np.zeros((len(trees), layout.n_max + 1), dtype=bool)  # a node of a tree with q
        offset = 0
        for s in with_q:
            n = len(trees[s])
            index[s, 1 : n + 1] = np.arange(offset, offset + n)
            is_q[s, 1 : n + 1] = True
            offset += n
        index_t = torch.from_numpy(index).to(device)
        at_token = probs[index_t, layout.tokens].double()
        at_token = torch.where(torch.from_numpy(is_q).to(device), at_token, 1.0)
        all_q = len(with_q) == sum(1 for t in trees if len(t))
        return cls(probs, index_t, torch.from_numpy(is_q.any(1)).to(device), at_token, all_q)


def _q(tree: DraftTree) -> torch.Tensor:
    assert tree.draft_probs is not None
    return tree.draft_probs


def _concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, without the copy when the parts are consecutive rows of one
    buffer (a proposer's q rows split per tree): 200 MB for 64 x 16 rows of a 49k vocabulary."""
    first = parts[0]
    offset, width = first.storage_offset(), first.shape[1]
    consecutive = all(
        p.is_contiguous()
        and p.dtype == first.dtype
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for p in parts
    )
    for p in parts:
        consecutive = consecutive and p.storage_offset() == offset
        offset += p.numel()
    if not consecutive:
        return torch.cat(parts)
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, width), (width, 1), first.storage_offset())


def verify_tree(
    logits: torch.Tensor,
    rows: SequenceT[SamplingRow],
    trees: SequenceT[DraftTree],
    generator: torch.Generator,
) -> TreeVerifyResult:
    """Accept/reject every sequence's draft tree against its target rows.

    ``logits``/``rows`` hold ``1 + len(trees[s])`` rows per sequence, sequence after sequence:
    the root's row, then node i's (built with node i's path as history, see :func:`tree_rows`).
    """
    if not trees:
        return TreeVerifyResult([], [], [])
    _check(logits, rows, trees)
    device = logits.device
    layout = _Layout.of(trees, device)
    t = SamplingTensors.build(rows, logits.shape[1], device)
    if t.all_greedy:
        return _result(trees, *_walk(layout, greedy_tokens(logits, t), None))
    p = target_probs(logits, t)
    unseeded = [
        s
        for s, first in enumerate(layout.first_rows)
        if not (rows[first].params.greedy or rows[first].params.seed is not None)
    ]
    targets = _targets(p, rows, trees, layout, unseeded)
    rejection = None
    if unseeded:  # known on the host: no wait on the device
        uniforms = torch.rand(
            len(trees),
            layout.n_max + 1,
            dtype=torch.float64,
            generator=generator,
            device=generator.device,
        ).to(device)
        rejection = _Rejection(p, layout, _Drafts.of(trees, layout, device), uniforms, unseeded)
    return _result(trees, *_walk(layout, targets, rejection))


def _targets(
    p: torch.Tensor,
    rows: SequenceT[SamplingRow],
    trees: SequenceT[DraftTree],
    layout: _Layout,
    unseeded: list[int],
) -> torch.Tensor:
    """Per row the argmax, or for seeded random rows their Gumbel-max sample (meaningless on
    the unseeded sequences' rows, which are not looked at: an argmax over [R, V] is not free)."""
    skip = set(unseeded)
    index = [
        first + j
        for s, (first, tree) in enumerate(zip(layout.first_rows, trees, strict=True))
        if s not in skip
        for j in range(len(tree) + 1)
    ]
    targets = torch.zeros(len(rows), dtype=torch.long, device=p.device)
    if index:
        at = torch.tensor(index, dtype=torch.long, device=p.device)
        picked = p[at]
        targets[at] = with_seeded_samples(row_argmax(picked), picked, [rows[i] for i in index])
    return targets


def _check(logits: torch.Tensor, rows: SequenceT[SamplingRow], trees: SequenceT[DraftTree]) -> None:
    expected = sum(len(t) + 1 for t in trees)
    if logits.shape[0] != expected or len(rows) != expected:
        raise ValueError(
            f"{len(trees)} trees need {expected} rows: got {logits.shape[0]} logits, "
            f"{len(rows)} sampling rows"
        )
    vocab = logits.shape[1]
    for t in trees:
        if t.tokens and not 0 <= min(t.tokens) <= max(t.tokens) < vocab:
            raise ValueError(f"draft token outside the vocabulary of {vocab}")
        if t.draft_probs is not None and t.draft_probs.shape[1] != vocab:
            raise ValueError(f"draft_probs have {t.draft_probs.shape[1]} columns, not {vocab}")


@dataclass
class _Stash:
    """``p_cur`` left at the depth-``depth`` branching nodes of some sequences once all their
    children were rejected: the final distribution of those that stop there."""

    depth: int
    at: torch.Tensor  # positions in ``_Rejection.unseeded``
    p_cur: torch.Tensor  # [len(at), V] float64, unnormalised


@dataclass
class _Rejection:
    """Recursive rejection sampling for the unseeded random sequences.

    ``p_cur`` is kept unnormalised with its mass beside it (1 for a target row as it comes), and
    q without earlier siblings is kept as q with those tokens zeroed and its mass
    ``z = 1 - q(earlier siblings)`` beside it; the test ``u < p_cur(c) / mass / (q(c) / z)`` and
    the residual ``max(0, z * p_cur - mass * q)`` (``z * mass`` times the normalised one) are
    then division-free, and exactly the chain verifier's at a node's first child.
    """

    p: torch.Tensor  # [R, V] target distributions (float32)
    layout: _Layout
    drafts: _Drafts | None
    uniforms: torch.Tensor  # [S, n_max + 1] float64
    unseeded: list[int]  # the sequences it decides
    mask: torch.Tensor = field(init=False)  # [S] bool: ``unseeded``
    seqs: torch.Tensor = field(init=False)  # ``unseeded`` on the device
    stashes: list[_Stash] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        device = self.p.device
        mask = torch.zeros(len(self.layout.first_rows), dtype=torch.bool)
        mask[self.unseeded] = True
        self.mask = mask.to(device)
        self.seqs = torch.tensor(self.unseeded, dtype=torch.long, device=device)

    def accept(self, cur: torch.Tensor, kids: torch.Tensor, depth: int) -> torch.Tensor:
        """The slot of the accepted child of each sequence's node ``cur`` (0: none)."""
        every = torch.arange(len(cur), device=cur.device)
        # A first child is tested with scalars only: p and q at its token (mass 1, z = 1).
        first, token = kids[:, 0], self.layout.tokens_of(kids[:, :1], every)[:, 0]
        q = self._q_at(first, every)
        passed = self._u(first, every) * q < self.p[self.layout.row_of(cur), token].double()
        child = torch.where((first > 0) & passed, first, 0)
        branching = set(self.layout.branching[depth])
        positions = [i for i, s in enumerate(self.unseeded) if s in branching]
        if positions:  # the [n, V] work: only where some node has siblings
            at = torch.tensor(positions, dtype=torch.long, device=cur.device)
            seqs = self.seqs[at]
            p_cur = self.p[self.layout.row_of(cur[seqs], seqs)].double()
            chosen, p_cur = self._siblings(seqs, p_cur, kids[seqs], decide=True)
            child[seqs] = chosen
            self.stashes.append(_Stash(depth, at, p_cur))
        return child

    def final(self, stop: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """The final token of every unseeded sequence, drawn from ``p_cur`` at its stop node
        ``stop`` (every child of which was rejected)."""
        seqs = self.seqs
        stop = stop[seqs]
        kids = self.layout.children_of(stop, seqs)[:, :1]
        p_cur = self.p[self.layout.row_of(stop, seqs)].double()
        # the one residual of a chain's node; a branching node's was kept by the walk
        _, p_cur = self._siblings(seqs, p_cur, kids, decide=False)
        depth = (path[seqs] >= 0).sum(1)
        for stash in self.stashes:
            here = depth[stash.at] == stash.depth
            p_cur[stash.at] = torch.where(here[:, None], stash.p_cur, p_cur[stash.at])
        return inverse_cdf(p_cur, self.uniforms[seqs, -1])

    def _siblings(
        self, seqs: torch.Tensor, p_cur: torch.Tensor, kids: torch.Tensor, decide: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One node's children ``kids`` per sequence in turn, from its target row ``p_cur``:
        ``decide`` tests them, otherwise they are all known rejected. Returns the accepted
        child's slot (0: none) and ``p_cur`` (unnormalised) after the rejections."""
        tokens = self.layout.tokens_of(kids, seqs)
        mass = torch.ones(len(seqs), dtype=torch.float64, device=seqs.device)
        child = torch.zeros(len(seqs), dtype=torch.long, device=seqs.device)
        for r in range(kids.shape[1]):
            slot, token = kids[:, r], tokens[:, r : r + 1]
            q, q_token, z = self._q_cur(seqs, kids, tokens, r)
            rejected = slot > 0
            if decide:
                rejected &= child == 0
                u = self._u(slot, seqs)
                passed = u * q_token * mass < p_cur.gather(1, token)[:, 0] * z
                child = torch.where(rejected & passed, slot, child)
                rejected &= ~passed
            p_cur, mass = self._reject(p_cur, mass, q, z if r else None, seqs, token, rejected)
        return child, p_cur

    def _q_cur(
        self, seqs: torch.Tensor, kids: torch.Tensor, tokens: torch.Tensor, r: int
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The q of each sequence's rank-r child with its earlier (rejected) siblings zeroed
        ``[n, V]`` (None: no tree has q), q at the child's token and the mass z of what is left
        (1 for point masses)."""
        one = torch.ones(len(seqs), dtype=torch.float64, device=seqs.device)
        if self.drafts is None:
            return None, one, one
        has_q = self.drafts.has_q[seqs]
        q = self.drafts.probs[self.drafts.index[seqs].gather(1, kids[:, r : r + 1])[:, 0]]
        q_token = q.gather(1, tokens[:, r : r + 1])[:, 0].double()
        z = one
        if r:  # drawn without replacement: the earlier siblings could not come again
            earlier = tokens[:, :r]
            # q taken as normalised, as its first child's test does; z >= q(c) against rounding
            z = (1.0 - q.gather(1, earlier).double().sum(1)).maximum(q_token)
            q.scatter_(1, earlier, 0.0)  # q is a fresh gather: zeroed in place
        return q, torch.where(has_q, q_token, 1.0), torch.where(has_q, z, 1.0)

    def _reject(
        self,
        p_cur: torch.Tensor,
        mass: torch.Tensor,
        q: torch.Tensor | None,
        z: torch.Tensor | None,
        seqs: torch.Tensor,
        token: torch.Tensor,
        rejected: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``p_cur`` and its mass after rejecting ``token`` where ``rejected``: the residual
        ``max(0, z * p_cur - mass * q)`` (``z`` None: 1, and then ``mass`` is 1 too: a node's
        first child), or a point mass's, ``p_cur`` without the token."""
        drafts = self.drafts
        point = None
        if drafts is None or not drafts.all_q:
            point = p_cur.scatter(1, token, 0.0)
        if q is None or drafts is None:
            assert point is not None
            residual = point
        else:
            if z is None:  # a node's first child (mass 1 too): the chain verifier's p - q
                residual = (p_cur - q).clamp_(min=0.0)
            else:
                residual = (p_cur * z[:, None]).addcmul_(q, mass[:, None], value=-1.0)
                residual.clamp_(min=0.0)
            if point is not None:
                residual = torch.where(drafts.has_q[seqs][:, None], residual, point)
        left = residual.sum(-1)
        # p == q up to rounding makes the residual empty: the rejection was an artefact
        usable = rejected & (left > 0)
        return torch.where(usable[:, None], residual, p_cur), torch.where(usable, left, mass)

    def _q_at(self, slots: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
        """q(token) of each sequence's slot, 1 for point masses."""
        if self.drafts is None:
            return torch.ones(len(slots), dtype=torch.float64, device=slots.device)
        return self.drafts.at_token[seqs].gather(1, slots[:, None])[:, 0]

    def _u(self, slots: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
        """The uniform that decides each sequence's slot (column node = slot - 1)."""
        return self.uniforms[seqs].gather(1, (slots - 1).clamp(min=0)[:, None])[:, 0]


def _walk(
    layout: _Layout, targets: torch.Tensor, rejection: _Rejection | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's accepted path ``[S, depth]`` (node indices, -1 past its end) and final
    token ``[S]``. ``targets`` are the greedy/seeded rows' tokens, ``rejection`` decides the
    unseeded random sequences."""
    device = targets.device
    every = torch.arange(len(layout.first_rows), device=device)
    cur = torch.zeros(len(every), dtype=torch.long, device=device)
    alive = torch.ones(len(every), dtype=torch.bool, device=device)
    path = torch.full((len(every), len(layout.widths)), -1, dtype=torch.long, device=device)
    for depth, width in enumerate(layout.widths):
        kids = layout.children_of(cur, every)[:, :width]
        want = targets[layout.row_of(cur)]
        hit = (kids > 0) & (layout.tokens_of(kids, every) == want[:, None])
        child = (kids * hit).sum(1)  # siblings are distinct: at most one hit
        if rejection is not None:
            child = torch.where(rejection.mask, rejection.accept(cur, kids, depth), child)
        child = torch.where(alive, child, 0)
        path[:, depth] = child - 1
        alive &= child > 0
        cur = torch.where(alive, child, cur)
    final = targets[layout.row_of(cur)]
    if rejection is not None:
        final[rejection.seqs] = rejection.final(cur, path)
    return path, final


def _result(
    trees: SequenceT[DraftTree], path: torch.Tensor, final: torch.Tensor
) -> TreeVerifyResult:
    # The one device-to-host transfer of the step.
    packed = torch.cat([path, final[:, None]], dim=1).tolist()
    nodes = [[n for n in row[:-1] if n >= 0] for row in packed]
    tokens = [
        [tree.tokens[n] for n in path_nodes] + [row[-1]]
        for tree, path_nodes, row in zip(trees, nodes, packed, strict=True)
    ]
    return TreeVerifyResult([len(n) for n in nodes], tokens, nodes)
