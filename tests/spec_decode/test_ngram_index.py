"""The incremental n-gram index against the whole-sequence scan it replaces."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from specbatch.sampling_params import SamplingParams
from specbatch.sequence import Sequence
from specbatch.spec_decode.proposers.base import DraftRequest, LookupMatch
from specbatch.spec_decode.proposers.ngram import (
    NgramIndex,
    NgramProposer,
    continuation_tree,
    is_chain,
    ngram_ends,
    ngram_match,
)
from specbatch.spec_decode.verification.tree import DraftTree


@pytest.mark.parametrize("seed", range(40))
def test_index_matches_the_scan_as_tokens_are_appended(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([2, 3, 5, 50, 1 << 21]))  # tiny vocabularies: many matches
    tokens = rng.integers(0, vocab, int(rng.integers(0, 30))).tolist()
    low = int(rng.integers(1, 4))
    high = low + int(rng.integers(0, 3))
    index = NgramIndex(low, high)
    for _ in range(25):
        expected = ngram_match(np.asarray(tokens, dtype=np.int64), low, high, 4)
        assert index.match(tokens, 4) == expected
        tokens += rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()


@pytest.mark.parametrize("limit", [1, 4])
def test_the_index_leaves_the_collector_nothing_to_scan(limit: int) -> None:
    """Every entry of a prompt's index is a tuple of ints, which the garbage collector stops
    tracking: with a list per n-gram (2,400 for a 600-token prompt) 32 sequences' indices put
    a gen-2 collection of 83 ms into a batch-32 run (stop 62, bfloat16, coding)."""
    tokens = np.random.default_rng(0).integers(0, 50, 600).tolist()
    index = NgramIndex(1, 4, limit)
    index.match(tokens, 4)
    gc.collect()
    assert len(index._ends) > 600
    assert not any(gc.is_tracked(key) or gc.is_tracked(ends) for key, ends in index._ends.items())


def test_a_replaced_list_is_indexed_again() -> None:
    index = NgramIndex(1, 3)
    assert index.match([1, 2, 3, 1, 2], 2) == ([3, 1], 2)
    assert index.match([7, 8, 7], 2) == ([8, 7], 1)  # shorter: not an extension


def test_proposer_keeps_one_index_per_sequence_and_forgets_it() -> None:
    proposer = NgramProposer(2, 4, shortest=1)
    seq = Sequence(0, "a", 0, [5, 6, 7, 5, 6], SamplingParams(max_tokens=8), 0.0)
    assert proposer.match(seq, 3) == LookupMatch([7, 5, 6], 2)
    seq.token_ids += [9, 5]
    assert proposer.match(seq, 3) == LookupMatch([], 0)  # only a 1-token match: under min_n
    # after the latest earlier 5
    assert proposer.match(seq, 3, min_n=1) == LookupMatch([6, 9, 5], 1)
    proposer.forget(seq)
    assert seq.seq_id not in proposer._indices


@pytest.mark.parametrize("seed", range(30))
def test_index_ends_match_the_scan(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    vocab = int(rng.choice([2, 3, 5, 50]))
    tokens = rng.integers(0, vocab, int(rng.integers(0, 20))).tolist()
    index = NgramIndex(1, 3, limit=4)
    for _ in range(20):
        index.match(tokens, 4)
        for n in range(1, 4):
            assert index.ends(tokens, n) == ngram_ends(np.asarray(tokens, dtype=np.int64), n, 4)
        tokens += rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()


def reference_tree(tokens: list[int], ends: list[int], max_nodes: int) -> set[tuple[int, ...]]:
    """The obvious construction: every prefix of every continuation is a path; the paths the
    most continuations begin with are kept, then the shorter, then the latest occurrence's."""
    counts: dict[tuple[int, ...], int] = {}
    order: dict[tuple[int, ...], int] = {}
    for j, end in enumerate(ends):
        continuation = tokens[end : end + max_nodes]
        for depth in range(1, len(continuation) + 1):
            path = tuple(continuation[:depth])
            counts[path] = counts.get(path, 0) + 1
            order.setdefault(path, j)
    ranked = sorted(counts, key=lambda p: (-counts[p], len(p), order[p]))
    return set(ranked[:max_nodes])


def tree_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(i)) for i in range(len(tree))}


@pytest.mark.parametrize("seed", range(40))
def test_continuation_tree_keeps_the_best_scored_paths(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    tokens = rng.integers(0, int(rng.choice([2, 3, 6])), int(rng.integers(2, 40))).tolist()
    n = int(rng.integers(1, 3))
    ends = ngram_ends(np.asarray(tokens, dtype=np.int64), n, 4)
    max_nodes = int(rng.integers(1, 9))
    tree = continuation_tree(tokens, ends, max_nodes)  # DraftTree checks it is a tree
    assert len(tree) == min(max_nodes, len(reference_tree(tokens, ends, 99)))
    assert tree_paths(tree) == reference_tree(tokens, ends, max_nodes)


def test_disagreeing_occurrences_become_siblings() -> None:
    #         a  b  X  .  a  b  Y  .  a  b
    tokens = [1, 2, 7, 0, 1, 2, 8, 0, 1, 2]
    tree = continuation_tree(tokens, ngram_ends(np.asarray(tokens), 2, 4), 4)
    # one occurrence each: the shallower nodes of both continuations, the latest's first
    assert tree.tokens == [8, 0, 7, 0]
    assert tree.parents == [-1, 0, -1, 2]
    one = continuation_tree(tokens, ngram_ends(np.asarray(tokens), 2, 4)[:1], 4)
    assert is_chain(one.parents)
    assert one.tokens == [8, 0, 1, 2]


def test_proposer_trees_only_where_occurrences_disagree() -> None:
    proposer = NgramProposer(1, 2, trees=True)  # "0 1 2" occurred once: a chain with n = 3
    seq = Sequence(0, "a", 0, [1, 2, 7, 0, 1, 2, 8, 0, 1, 2], SamplingParams(max_tokens=8), 0.0)
    proposal = proposer.propose([DraftRequest(seq, 4)])
    assert proposal.tokens == [[8, 0, 7, 0]]
    assert proposal.parents == [[-1, 0, -1, 2]]
    agreeing = Sequence(1, "a", 0, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=8), 0.0)
    proposal = proposer.propose([DraftRequest(agreeing, 4)])
    assert proposal.tokens == [[3, 1, 2, 3]]
    assert proposal.parents is None
