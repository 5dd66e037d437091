"""The tree verifier against an obvious per-sequence reference, the chain verifier, the exact
target distribution (chi-square) and its edge cases."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specbatch.kernels.sampling import (
    SamplingRow,
    SamplingTensors,
    gumbel_argmax,
    gumbel_noise,
    sample,
    target_probs,
)
from specbatch.sampling_params import SamplingParams
from specbatch.sequence import Sequence
from specbatch.spec_decode.verification.chain import verify
from specbatch.spec_decode.verification.tree import (
    DraftTree,
    TreeVerifyResult,
    tree_rows,
    verify_tree,
)

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
RANDOM = SamplingParams(temperature=1.0)


# ----------------------------------------------------------------------------- the reference


def children_of(tree: DraftTree) -> list[list[int]]:
    """Children of the root (index 0) and of node i (index 1 + i), in node order."""
    children: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for i, parent in enumerate(tree.parents):
        children[parent + 1].append(i)
    return children


def seeded_or_greedy_target(p_row: torch.Tensor, row: SamplingRow) -> int:
    if row.params.greedy:
        return int(p_row.argmax())  # target_probs is one-hot on the argmax
    assert row.params.seed is not None
    noise = gumbel_noise(row.params.seed, row.position, len(p_row), CPU)
    return int(gumbel_argmax(p_row, noise))


def reference_verify_tree(
    p_rows: list[torch.Tensor],
    rows: list[SamplingRow],
    tree: DraftTree,
    uniforms: list[float],
) -> tuple[list[int], list[int]]:
    """One sequence, loops and float64: (accepted nodes, emitted tokens). ``uniforms[i]``
    decides node i, ``uniforms[-1]`` draws the final token (unseeded random rows only)."""
    children = children_of(tree)
    params = rows[0].params
    node, accepted = -1, list[int]()
    while True:
        p_cur = p_rows[node + 1].double().clone()
        kids = children[node + 1]
        if params.greedy or params.seed is not None:
            want = seeded_or_greedy_target(p_cur, rows[node + 1])
            hits = [c for c in kids if tree.tokens[c] == want]
            if not hits:
                return accepted, [tree.tokens[n] for n in accepted] + [want]
            node = hits[0]
            accepted.append(node)
            continue
        # Target and draft rows are taken as distributions as they come (mass 1, not
        # renormalised: a float32 softmax sums to 1 only up to ~1e-7), as the chain verifier
        # does; the rest is float64 and differs from the batched arithmetic by ~1e-16 only.
        mass = 1.0
        chosen = None
        for rank, c in enumerate(kids):
            token = tree.tokens[c]
            p_norm = p_cur / mass
            q_cur = torch.zeros_like(p_cur)
            q_cur[token] = 1.0  # a point mass
            if tree.draft_probs is not None:
                q_cur = tree.draft_probs[c].double().clone()
                earlier = [tree.tokens[k] for k in kids[:rank]]
                left = max(1.0 - float(q_cur[earlier].sum()), float(q_cur[token]))
                q_cur[earlier] = 0.0
                q_cur /= left
            ratio = float(p_norm[token]) / float(q_cur[token]) if q_cur[token] > 0 else 1.0
            if uniforms[c] < min(1.0, ratio) and p_norm[token] > 0:
                chosen = c
                break
            residual = (p_norm - q_cur).clamp(min=0.0)  # a point mass's: p without the token
            if float(residual.sum()) > 0:  # else p == q by rounding: keep p_cur
                p_cur, mass = residual, float(residual.sum())
        if chosen is None:
            final = pick(p_cur, uniforms[-1])
            return accepted, [tree.tokens[n] for n in accepted] + [final]
        node = chosen
        accepted.append(node)


def pick(weights: torch.Tensor, u: float) -> int:
    """Inverse CDF with a sequential running sum."""
    cdf = list(itertools.accumulate(weights.tolist()))
    target = u * cdf[-1]
    for token, total in enumerate(cdf):
        if total > target:
            return token
    return len(cdf) - 1


# ----------------------------------------------------------------------------- random cases


@dataclass
class Batch:
    logits: torch.Tensor
    rows: list[SamplingRow]
    trees: list[DraftTree]

    def per_sequence(self) -> list[tuple[list[torch.Tensor], list[SamplingRow], DraftTree]]:
        t = SamplingTensors.build(self.rows, self.logits.shape[1], CPU)
        p = target_probs(self.logits, t).double()
        out, start = [], 0
        for tree in self.trees:
            n = len(tree) + 1
            out.append((list(p[start : start + n]), self.rows[start : start + n], tree))
            start += n
        return out


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "seeded", "unseeded", "unseeded"])
    if kind == "greedy":
        return GREEDY
    params = SamplingParams(
        temperature=rng.choice([1.0, 1.0, 0.7, 1.5]),
        top_k=rng.choice([0, 0, 3]),
        top_p=rng.choice([1.0, 1.0, 0.8]),
    )
    return params.clone(seed=rng.randrange(1000)) if kind == "seeded" else params


def random_logits(gen: torch.Generator, vocab: int) -> torch.Tensor:
    logits = torch.randn(vocab, generator=gen) * 2.0
    if torch.rand(1, generator=gen).item() < 0.3:  # some tokens impossible
        banned = torch.rand(vocab, generator=gen) < 0.4
        banned[int(logits.argmax())] = False
        logits[banned] = float("-inf")
    return logits


def random_shape(rng: random.Random) -> str:
    return rng.choice(["empty", "single", "chain", "bushy", "bushy", "bushy"])


def child_counts(rng: random.Random, shape: str, depth: int) -> int:
    """How many children a depth-``depth`` slot gets (the root is depth 0)."""
    if shape == "empty":
        return 0
    if shape == "single":
        return 1 if depth == 0 else 0
    if shape == "chain":
        return 1 if depth < rng.randint(1, 5) else 0
    return rng.randint(2, 4) if depth < rng.randint(2, 3) else rng.choice([0, 0, 1])


def random_sequence(
    rng: random.Random, gen: torch.Generator, vocab: int, with_q: bool, max_nodes: int = 16
) -> tuple[list[torch.Tensor], list[SamplingRow], DraftTree]:
    """A random tree grown breadth-first: each new node gets its own target row; children are
    drawn without replacement from a draft q near the parent's target logits."""
    params = random_params(rng)
    shape = random_shape(rng)
    noise = rng.choice([0.0, 0.5, 3.0])
    logits = [random_logits(gen, vocab)]
    depth_of, tokens, parents, q_rows = [0], list[int](), list[int](), list[torch.Tensor]()
    slot = 0
    while slot < len(logits):
        q = (logits[slot].clamp(min=-30) + noise * torch.randn(vocab, generator=gen)).softmax(-1)
        wanted = child_counts(rng, shape, depth_of[slot])
        k = min(wanted, int((q > 0).sum()), max_nodes - len(tokens))
        if k > 0:
            drawn = torch.multinomial(q, k, replacement=False, generator=gen).tolist()
            for token in drawn:
                tokens.append(token)
                parents.append(slot - 1)
                q_rows.append(q)
                depth_of.append(depth_of[slot] + 1)
                logits.append(random_logits(gen, vocab))
        slot += 1
    base = rng.randrange(100)
    rows = [SamplingRow(params, [], [], base + d) for d in depth_of]
    draft_probs = torch.stack(q_rows) if with_q and q_rows else None
    return logits, rows, DraftTree(tokens, parents, draft_probs)


def random_batch(seed: int, size: int) -> Batch:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = rng.randint(7, 12)
    no_q = seed % 3 == 0  # whole batches of point masses: no q at all
    all_logits, all_rows, trees = [], [], []
    for _ in range(size):
        logits, rows, tree = random_sequence(rng, gen, vocab, not no_q and rng.random() < 0.6)
        all_logits += logits
        all_rows += rows
        trees.append(tree)
    return Batch(torch.stack(all_logits), all_rows, trees)


def uniforms_for(batch: Batch, seed: int) -> list[list[float]]:
    n_max = max(len(t) for t in batch.trees)
    stream = torch.Generator().manual_seed(seed)
    return torch.rand(len(batch.trees), n_max + 1, dtype=torch.float64, generator=stream).tolist()


@pytest.mark.parametrize("seed", range(10))
def test_matches_reference_on_random_trees(seed: int) -> None:
    batch = random_batch(seed, 30)  # 300 sequences over the ten seeds
    result = verify_tree(batch.logits, batch.rows, batch.trees, torch.Generator().manual_seed(7))
    uniforms = uniforms_for(batch, 7)  # the same stream, re-seeded
    for s, (p_rows, rows, tree) in enumerate(batch.per_sequence()):
        nodes, tokens = reference_verify_tree(p_rows, rows, tree, uniforms[s])
        assert result.accepted_nodes[s] == nodes, f"sequence {s}"
        assert result.tokens[s] == tokens, f"sequence {s}"
        assert result.num_accepted[s] == len(nodes)


def test_random_cases_cover_the_interesting_paths() -> None:
    """The random cases really hold accepted later siblings, deep paths and every row kind."""
    later_sibling = deep = 0
    kinds = set()
    for seed in range(10):
        batch = random_batch(seed, 30)
        result = verify_tree(
            batch.logits, batch.rows, batch.trees, torch.Generator().manual_seed(7)
        )
        for tree, nodes, (_, rows, _) in zip(
            batch.trees, result.accepted_nodes, batch.per_sequence(), strict=True
        ):
            children = children_of(tree)
            params = rows[0].params
            seeded = params.seed is not None
            kinds.add("greedy" if params.greedy else "seeded" if seeded else "random")
            deep += len(nodes) >= 2
            later_sibling += any(children[tree.parents[n] + 1][0] != n for n in nodes)
    assert kinds == {"greedy", "seeded", "random"}
    assert deep > 20
    assert later_sibling > 20


# ----------------------------------------------------------------------------- chains


@pytest.mark.parametrize("kind", ["greedy", "seeded", "unseeded", "mixed"])
@pytest.mark.parametrize("point_mass", [False, True])
def test_chains_match_the_chain_verifier(kind: str, point_mass: bool) -> None:
    """A chain is what ``rejection.verify`` verifies: same tokens, same uniforms consumed (the
    layout ``[S, n_max + 1]``, column j for draft j and the last for the final token, is the
    chain verifier's). The residuals are float64 here and float32 there, so the two could part
    on a uniform within ~1e-7 of a CDF boundary; with these fixed seeds they never do."""
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    vocab = 9
    all_logits, all_rows, drafts, q_rows, trees = [], [], [], [], []
    for s in range(40):
        k = s % 6
        params = {
            "greedy": GREEDY,
            "seeded": RANDOM.clone(seed=s),
            "unseeded": RANDOM,
            "mixed": [GREEDY, RANDOM.clone(seed=s), RANDOM, RANDOM][s % 4],
        }[kind]
        rows_logits = [random_logits(gen, vocab) for _ in range(k + 1)]
        noise = rng.choice([0.0, 0.5, 2.0])
        qs = [
            (rows_logits[j].clamp(min=-30) + noise * torch.randn(vocab, generator=gen)).softmax(-1)
            for j in range(k)
        ]
        chain = [int(torch.multinomial(q, 1, generator=gen)) for q in qs]
        all_logits += rows_logits
        all_rows += [SamplingRow(params, [], [], 20 + j) for j in range(k + 1)]
        drafts.append(chain)
        q_rows += qs
        trees.append(
            DraftTree.chain(chain, None if point_mass else torch.stack(qs) if qs else None)
        )
    logits = torch.stack(all_logits)
    q = None if point_mass else torch.stack(q_rows)
    g_chain, g_tree = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    expected = verify(logits, all_rows, drafts, q, g_chain)
    result = verify_tree(logits, all_rows, trees, g_tree)
    assert result.tokens == expected.tokens
    assert result.num_accepted == expected.num_accepted
    assert result.accepted_nodes == [list(range(m)) for m in expected.num_accepted]
    assert torch.equal(torch.rand(4, generator=g_chain), torch.rand(4, generator=g_tree))
    assert 0 < sum(expected.num_accepted) < sum(len(d) for d in drafts)


# ----------------------------------------------------------------------------- distribution

DV = 6
N = 20000
SHAPE = [-1, -1, -1, 0, 0, 1, 1, 2, 2]  # three children of the root, two below each


def _fixed_logits(path: tuple[int, ...], salt: int) -> torch.Tensor:
    seed = salt + sum((t + 1) * 7 ** (i + 1) for i, t in enumerate(path))
    return torch.randn(DV, generator=torch.Generator().manual_seed(seed)) * 1.5


def target_logits(path: tuple[int, ...]) -> torch.Tensor:
    return _fixed_logits(path, 1)


def draft_probs_at(path: tuple[int, ...]) -> torch.Tensor:
    """A draft near the target: its logits plus some of their own."""
    return (target_logits(path) + _fixed_logits(path, 5000)).softmax(-1)


def table(fn: Callable[[tuple[int, ...]], torch.Tensor], length: int) -> torch.Tensor:
    """``fn`` at every path of ``length`` tokens, ``[DV] * length + [DV]``."""
    values = [fn(path) for path in itertools.product(range(DV), repeat=length)]
    return torch.stack(values).view(*([DV] * length), DV)


LOGITS = [table(target_logits, n) for n in range(4)]
DRAFT = [table(draft_probs_at, n) for n in range(3)]


def bushy_batch(
    prefixes: torch.Tensor,
    params: list[SamplingParams],
    sampled: bool,
    gen: torch.Generator,
    base: int = 10,
) -> tuple[torch.Tensor, list[SamplingRow], list[DraftTree]]:
    """The ``SHAPE`` tree after each prefix (``[n, 0]`` or ``[n, 1]``): children drawn without
    replacement from the draft per sequence (``sampled``), or its deterministic top-k."""
    n, length = prefixes.shape
    at = tuple(prefixes[:, i : i + 1] for i in range(length))  # [n, 1]: broadcast on children

    def children(q: torch.Tensor, k: int) -> torch.Tensor:
        if sampled:
            return torch.multinomial(q, k, replacement=False, generator=gen)
        return q.topk(k, dim=-1).indices

    q_root = DRAFT[length][at].view(n, DV) if length else DRAFT[0].expand(n, DV)
    first = children(q_root, 3)  # [n, 3]
    below_first = (*at, first)
    q_first = DRAFT[length + 1][below_first]  # [n, 3, V]
    second = children(q_first.reshape(-1, DV), 2).view(n, 3, 2)
    tokens = torch.cat([first, second.reshape(n, 6)], 1)
    q_nodes = torch.cat([q_root[:, None].expand(n, 3, DV), q_first.repeat_interleave(2, 1)], 1)
    root = LOGITS[length][at].view(n, DV) if length else LOGITS[0].expand(n, DV)
    below_second = (*at, first.repeat_interleave(2, 1), second.reshape(n, 6))
    logits = torch.cat(
        [
            root[:, None],
            LOGITS[length + 1][below_first],
            LOGITS[length + 2][below_second],
        ],
        1,
    ).reshape(-1, DV)
    depths = [0, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    rows = [SamplingRow(p, [], [], base + length + d) for p in params for d in depths]
    trees = [
        DraftTree(toks, SHAPE, q_nodes[i] if sampled else None)
        for i, toks in enumerate(tokens.tolist())
    ]
    return logits, rows, trees


def first_two_tokens(
    params: list[SamplingParams], sampled: bool, seed: int
) -> tuple[np.ndarray, int]:
    """Two tokens per sequence: one verify step, and a second for those that stopped at once
    (how many did is returned too)."""
    gen = torch.Generator().manual_seed(seed)
    out = np.zeros((len(params), 2), dtype=np.int64)
    logits, rows, trees = bushy_batch(
        torch.zeros(len(params), 0, dtype=torch.long), params, sampled, gen
    )
    first = verify_tree(logits, rows, trees, gen)
    again = [i for i, t in enumerate(first.tokens) if len(t) == 1]
    for i, t in enumerate(first.tokens):
        out[i, : len(t[:2])] = t[:2]
    if again:
        prefixes = torch.tensor([[first.tokens[i][0]] for i in again], dtype=torch.long)
        logits, rows, trees = bushy_batch(prefixes, [params[i] for i in again], sampled, gen)
        second = verify_tree(logits, rows, trees, gen)
        out[again, 1] = [t[0] for t in second.tokens]
    return out, len(again)


def exact_joint(params: SamplingParams) -> np.ndarray:
    """P(t1, t2) ``[V, V]`` from the fixed target with the same processing."""
    logits = torch.cat([LOGITS[0][None], LOGITS[1]])
    rows = [SamplingRow(params, [], [], 10 + (i > 0)) for i in range(len(logits))]
    p = target_probs(logits, SamplingTensors.build(rows, DV, CPU)).double()
    return (p[0][:, None] * p[1:]).numpy()


def assert_chisquare(observed: np.ndarray, expected: np.ndarray) -> None:
    # Cells expected below 5 are pooled into one, as the chi-square approximation needs.
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was produced"
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()
    assert chisquare(obs, exp)[1] > 1e-3


def assert_follows_target(tokens: np.ndarray, params: SamplingParams) -> None:
    observed = np.bincount(tokens[:, 0] * DV + tokens[:, 1], minlength=DV * DV).astype(float)
    assert_chisquare(observed, exact_joint(params).reshape(-1) * len(tokens))


DIST_PARAMS = {
    "plain": RANDOM,
    "top-k": SamplingParams(temperature=1.0, top_k=3),
    "top-p": SamplingParams(temperature=1.0, top_p=0.8),
    "top-k-top-p": SamplingParams(temperature=1.0, top_k=4, top_p=0.9),
}


@pytest.mark.parametrize("name", list(DIST_PARAMS))
@pytest.mark.parametrize("sampled", [True, False], ids=["without-replacement", "top-k-points"])
def test_first_two_tokens_follow_the_target(name: str, sampled: bool) -> None:
    params = DIST_PARAMS[name]
    tokens, stopped_at_root = first_two_tokens([params] * N, sampled, seed=len(name))
    assert_follows_target(tokens, params)
    assert stopped_at_root < N // 2  # the tree's second level decided most second tokens
    # ... and a second step the others; except where the draft's top-3 holds the target's
    # whole top-3 support: a point mass is then accepted at the root every time
    assert stopped_at_root > 100 or (name == "top-k" and not sampled)


def test_seeded_rows_follow_the_target_over_seeds() -> None:
    params = [RANDOM.clone(seed=i) for i in range(N)]
    tokens, stopped_at_root = first_two_tokens(params, sampled=True, seed=1)
    assert_follows_target(tokens, RANDOM)
    assert 100 < stopped_at_root < N // 2


def test_a_seeded_output_does_not_depend_on_the_tree() -> None:
    params = SamplingParams(temperature=1.0, seed=4242)
    own: list[int] = []
    for k in range(3):  # the target's own seeded samples at positions 10, 11, 12
        p = target_logits(tuple(own)).softmax(-1)
        own.append(int(gumbel_argmax(p, gumbel_noise(4242, 10 + k, DV, CPU))))
    other = [(t + 1) % DV for t in own]
    trees = [
        DraftTree.chain(own[:2]),  # all accepted
        DraftTree([other[0], own[0], other[1], own[1]], [-1, -1, 1, 1]),  # later siblings
        DraftTree.chain([other[0], own[1]]),  # rejected at once
        DraftTree([], []),
    ]
    logits, rows = [], []
    for tree in trees:
        for node in [-1, *range(len(tree))]:
            path = tuple(tree.path_tokens(node)) if node >= 0 else ()
            logits.append(target_logits(path))
            rows.append(SamplingRow(params, [], [], 10 + len(path)))
    result = verify_tree(torch.stack(logits), rows, trees, torch.Generator())
    assert result.tokens == [own, own, own[:1], own[:1]]


# ----------------------------------------------------------------------------- edge cases


def rows_for(trees: list[DraftTree], params: SamplingParams) -> list[SamplingRow]:
    return [SamplingRow(params, [], [], 5) for t in trees for _ in range(len(t) + 1)]


def test_empty_batch() -> None:
    result = verify_tree(torch.empty(0, 8), [], [], torch.Generator())
    assert result == TreeVerifyResult([], [], [])


@pytest.mark.parametrize(
    "params", [GREEDY, RANDOM, RANDOM.clone(seed=3)], ids=["greedy", "random", "seeded"]
)
def test_empty_trees_are_plain_sampling(params: SamplingParams) -> None:
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(params, [], [], 7) for _ in range(6)]
    trees = [DraftTree([], [])] * 6
    result = verify_tree(logits, rows, trees, torch.Generator().manual_seed(1))
    expected = sample(logits, rows, torch.Generator().manual_seed(1)).tolist()
    assert result.tokens == [[t] for t in expected]
    assert result.num_accepted == [0] * 6
    if params.greedy:
        assert expected == logits.argmax(-1).tolist()


def deep_tree() -> DraftTree:
    """Three levels; the first child's line (nodes 0, 2, 5) is the deepest."""
    return DraftTree([1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 2])


@pytest.mark.parametrize("with_q", [True, False])
def test_all_drafts_accepted_and_the_bonus_from_the_deepest_row(with_q: bool) -> None:
    tree = deep_tree()
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(2))
    if not with_q:  # point masses: certain where the target is one-hot on them
        for slot, token in [(0, 1), (1, 3), (3, 6)]:
            logits[slot] = float("-inf")
            logits[slot, token] = 0.0
    logits[6] = float("-inf")
    logits[6, 7] = 0.0  # the deepest node's row: the bonus is 7
    rows = rows_for([tree], RANDOM)
    p = target_probs(logits, SamplingTensors.build(rows, 8, CPU))
    # q == p: every first child is accepted (u * q < p for u < 1)
    q = p[[t + 1 for t in tree.parents]] if with_q else None
    for seed in range(20):
        trees = [DraftTree(tree.tokens, tree.parents, q)]
        result = verify_tree(logits, rows, trees, torch.Generator().manual_seed(seed))
        assert result.accepted_nodes == [[0, 2, 5]]
        assert result.tokens == [[1, 3, 6, 7]]


def test_greedy_accepts_the_matching_sibling_down_to_the_bonus() -> None:
    tree = deep_tree()
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(3))
    for slot, token in [(0, 2), (2, 5), (5, 3)]:  # root -> node 1 -> node 4 -> bonus 3
        logits[slot, token] = 10.0
    result = verify_tree(logits, rows_for([tree], GREEDY), [tree], torch.Generator())
    assert result.accepted_nodes == [[1, 4]]
    assert result.tokens == [[2, 5, 3]]


@pytest.mark.parametrize("params", [GREEDY, RANDOM], ids=["greedy", "random"])
@pytest.mark.parametrize("with_q", [True, False])
def test_all_drafts_rejected(params: SamplingParams, with_q: bool) -> None:
    """Children the target gives probability 0 (greedy: never the argmax) are always rejected
    and never emitted, also by the residuals of later siblings."""
    tree = DraftTree([5, 6, 7, 5], [-1, -1, -1, 0])
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(4))
    logits[:, 5:] = float("-inf")
    q = torch.full((4, 8), 0.02)
    q[:, 5:] = 0.3  # the draft's mass is on what it proposed
    trees = [DraftTree(tree.tokens, tree.parents, q if with_q else None)] * 50
    result = verify_tree(
        logits.repeat(50, 1), rows_for(trees, params), trees, torch.Generator().manual_seed(0)
    )
    assert result.num_accepted == [0] * 50
    assert all(t[0] < 5 for t in result.tokens)


def test_an_empty_residual_falls_back_to_the_target() -> None:
    """q == p and a child of probability 0 under both: its rejection had probability 0, so the
    residual max(0, p - q) is empty; the final token comes from p (never the child, here the
    last token, which an all-zero row would yield)."""
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))
    logits[:, 7] = float("-inf")
    rows = rows_for([DraftTree([7], [-1])], RANDOM)
    p = target_probs(logits, SamplingTensors.build(rows, 8, CPU))
    trees = [DraftTree([7], [-1], p[:1].clone())] * 40
    result = verify_tree(logits.repeat(40, 1), rows * 40, trees, torch.Generator())
    assert result.num_accepted == [0] * 40
    assert all(t[0] != 7 for t in result.tokens)


def test_malformed_trees_are_refused() -> None:
    with pytest.raises(ValueError, match="sibling"):
        DraftTree([3, 4, 3], [-1, -1, -1])
    with pytest.raises(ValueError, match="sibling"):
        DraftTree([1, 2, 2], [-1, 0, 0])
    DraftTree([1, 2, 2], [-1, 0, 1])  # the same token under different parents is fine
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree([1, 2], [1, -1])
    with pytest.raises(ValueError, match="one row per node"):
        DraftTree([1, 2], [-1, 0], torch.ones(3, 8))
    tree = DraftTree([1], [-1])
    with pytest.raises(ValueError, match="rows"):
        verify_tree(
            torch.zeros(3, 8), rows_for([tree, tree], RANDOM)[:3], [tree], torch.Generator()
        )


def test_q_as_views_of_one_buffer_or_as_copies() -> None:
    """q rows that are consecutive rows of one tensor are used without a copy: same result."""
    batch = random_batch(1, 30)
    sizes = [len(t) for t in batch.trees]
    gen = torch.Generator().manual_seed(8)
    buffer = torch.rand(sum(sizes), batch.logits.shape[1], generator=gen).softmax(-1)
    views = list(buffer.split(sizes))
    viewed = [DraftTree(t.tokens, t.parents, v) for t, v in zip(batch.trees, views, strict=True)]
    copied = [
        DraftTree(t.tokens, t.parents, v.clone()) for t, v in zip(batch.trees, views, strict=True)
    ]
    results = [
        verify_tree(batch.logits, batch.rows, trees, torch.Generator().manual_seed(2))
        for trees in (viewed, copied)
    ]
    assert results[0] == results[1]


def test_tree_rows_give_each_node_its_path_as_history() -> None:
    params = SamplingParams(temperature=1.0, presence_penalty=0.5)
    seq = Sequence(0, "0", 0, [3, 4, 5], params, 0.0)
    tree = DraftTree([1, 2, 6], [-1, 0, -1])
    rows = tree_rows(seq, tree)
    assert [list(r.output_ids) for r in rows] == [[], [1], [1, 2], [6]]
    assert [r.position for r in rows] == [3, 4, 5, 4]
