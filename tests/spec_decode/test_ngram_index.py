"""The incremental n-gram index against the whole-sequence scan it replaces."""

from __future__ import annotations

import numpy as np
import pytest

from specbatch.sampling_params import SamplingParams
from specbatch.sequence import Sequence
from specbatch.spec_decode.ngram import NgramIndex, NgramProposer, ngram_match


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


def test_a_replaced_list_is_indexed_again() -> None:
    index = NgramIndex(1, 3)
    assert index.match([1, 2, 3, 1, 2], 2) == ([3, 1], 2)
    assert index.match([7, 8, 7], 2) == ([8, 7], 1)  # shorter: not an extension


def test_proposer_keeps_one_index_per_sequence_and_forgets_it() -> None:
    proposer = NgramProposer(2, 4, shortest=1)
    seq = Sequence(0, "a", 0, [5, 6, 7, 5, 6], SamplingParams(max_tokens=8), 0.0)
    assert proposer.match(seq, 3) == ([7, 5, 6], 2)
    seq.token_ids += [9, 5]
    assert proposer.match(seq, 3) == ([], 0)  # only a 1-token match: under min_n
    assert proposer.match(seq, 3, min_n=1) == ([6, 9, 5], 1)  # after the latest earlier 5
    proposer.forget(seq)
    assert seq.seq_id not in proposer._indices
