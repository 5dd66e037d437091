"""Drafting k as a ceiling (the draft's confidence stops it early) and the hybrid proposer
(each request drafted the way its plan chose: prompt lookup's match, or the draft model).

The confidence stop is compared with a slow reference that re-runs the draft over the whole
sequence for every draft token; the hybrid proposer with the proposers it combines, run alone.
Speed is measured in ``benchmarks/spec_decode.py``; the output identity and the exact sampling
distribution of both are checked in ``test_spec_engine.py`` and ``test_distribution.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.errors import ConfigError
from specbatch.models import load_model
from specbatch.sequence import Sequence
from specbatch.spec_decode.config import SpeculativeConfig
from specbatch.spec_decode.proposers.base import DraftRequest, with_point_masses
from specbatch.spec_decode.proposers.draft_model import DraftModelNetwork
from specbatch.spec_decode.proposers.drafting import NetworkProposer
from specbatch.spec_decode.proposers.hybrid import HybridProposer
from specbatch.spec_decode.proposers.ngram import NgramProposer, ngram_propose
from tests.helpers import (
    GREEDY,
    OFF,
    PagedHarness,
    engine_kwargs,
    greedy_tokens,
    prompts_with_repeats,
)

BLOCK = 4
K = 5


def drafter(draft_dir: Path, threshold: float = 0.0) -> NetworkProposer:
    return NetworkProposer(
        DraftModelNetwork(load_model(draft_dir)),
        num_blocks=256,
        block_size=BLOCK,
        generator=torch.Generator().manual_seed(0),
        confidence_threshold=threshold,
    )


def sequences(prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[Sequence]:
    out, next_block = [], 0
    for i, prompt in enumerate(prompts):
        seq = Sequence(i, str(i), 0, prompt, params, 0.0)
        blocks = (len(prompt) + K) // BLOCK + 1
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        out.append(seq)
    return out


def reference_drafts(draft_dir: Path, prompt: list[int], k: int) -> tuple[list[int], list[float]]:
    """Greedy drafts by a full forward over the whole sequence for each one, and the draft's
    P(all drafts so far are right) after each."""
    model = load_model(draft_dir)
    drafts: list[int] = []
    products: list[float] = []
    confidence = 1.0
    for _ in range(k):
        harness = PagedHarness(model, num_blocks=64, block_size=BLOCK)
        probs = harness.forward([(0, prompt + drafts)])[0][-1].softmax(-1)
        token = int(probs.argmax())
        confidence *= float(probs[token])
        drafts.append(token)
        products.append(confidence)
    return drafts, products


def expected_length(products: list[float], threshold: float, max_drafts: int) -> int:
    """Drafting goes on while the product is at least the threshold (the first draft always)."""
    length = 1
    while length < max_drafts and products[length - 1] >= threshold:
        length += 1
    return length


def test_confidence_stop_matches_slow_reference(tiny_draft_dir: Path) -> None:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, int(rng.integers(2, 14))).tolist() for _ in range(8)]
    max_drafts = [K, K, 2, K, 1, K, 3, K]
    reference = [reference_drafts(tiny_draft_dir, p, K) for p in prompts]
    # thresholds between the sequences' products, so that they stop at different drafts
    middle = float(np.median([products[1] for _, products in reference]))
    for threshold in (0.0, middle, float(np.median([p[0] for _, p in reference])), 0.999):
        proposer = drafter(tiny_draft_dir, threshold)
        seqs = sequences(prompts)
        proposal = proposer.propose(
            [DraftRequest(s, m) for s, m in zip(seqs, max_drafts, strict=True)]
        )
        lengths = []
        for (drafts, products), got, most in zip(
            reference, proposal.tokens, max_drafts, strict=True
        ):
            length = expected_length(products, threshold, most)
            assert got == drafts[:length]
            lengths.append(length)
        if threshold == middle:
            assert len(set(lengths)) > 1  # the batch really stopped rows at different steps
        if threshold == 0.999:
            assert lengths == [1] * len(prompts)


def test_confidence_stop_keeps_greedy_output_and_drafts_less(
    tiny_model_dir: Path, tiny_draft_dir: Path
) -> None:
    prompts = prompts_with_repeats(12, seed=4)
    plain = LLM(str(tiny_model_dir), speculative_config=OFF, **engine_kwargs())
    reference = greedy_tokens(plain, prompts)
    per_draft = {}
    for threshold in (0.0, 0.02):
        config = {
            "method": "draft_model",
            "model": str(tiny_draft_dir),
            "num_speculative_tokens": 4,
            "draft_confidence_threshold": threshold,
        }
        llm = LLM(str(tiny_model_dir), speculative_config=config, **engine_kwargs())
        assert greedy_tokens(llm, prompts) == reference
        stats = llm.llm_engine.stats
        per_draft[threshold] = stats.num_draft_tokens / stats.num_drafts
    assert per_draft[0.02] < per_draft[0.0]


def hybrid(draft_dir: Path, min_n: int) -> HybridProposer:
    return HybridProposer(NgramProposer(min_n, 4), drafter(draft_dir))


def planned_requests(proposer: HybridProposer, seqs: list[Sequence], k: int) -> list[DraftRequest]:
    """Each sequence's request as a plan makes it: its lookup's match where it has one (a
    plan may choose either; here the lookup wins whenever it matched), else the network."""
    assert proposer.lookup is not None
    requests = []
    for seq in seqs:
        match = proposer.lookup.match(seq, k)
        requests.append(DraftRequest(seq, k, lookup=match if match.tokens else None))
    return requests


def test_hybrid_drafts_each_request_the_way_its_plan_chose(tiny_draft_dir: Path) -> None:
    rng = np.random.default_rng(5)
    phrase = rng.integers(3, 300, 6).tolist()
    prompts = [
        phrase * 3,  # repeats: a lookup
        rng.integers(3, 300, 9).tolist(),  # no repeat of 2 tokens: drafted
        phrase + [7, 8, 9, 7, 8],  # "7 8" seen before: a lookup of what followed
        rng.integers(3, 300, 5).tolist(),
    ]
    proposer = hybrid(tiny_draft_dir, 2)
    proposal = proposer.propose(planned_requests(proposer, sequences(prompts), 3))
    alone = drafter(tiny_draft_dir).propose(
        [DraftRequest(s, 3) for s in sequences([prompts[1], prompts[3]])]
    )
    lookups = [ngram_propose(np.array(p), 2, 4, 3) for p in prompts]
    assert [bool(found) for found in lookups] == [True, False, True, False]
    assert proposal.tokens == [lookups[0], alone.tokens[0], lookups[2], alone.tokens[1]]
    assert proposal.draft_probs is None  # greedy: every draft is a point mass
    assert len(proposal.forward_times) == len(alone.forward_times) == 3  # a forward a draft


def test_hybrid_all_looked_up_runs_no_draft_forward(tiny_draft_dir: Path) -> None:
    proposer = hybrid(tiny_draft_dir, 1)
    calls: list[object] = []
    network = proposer._network.net
    assert isinstance(network, DraftModelNetwork)
    assert network.runner is not None
    network.runner.forward = lambda *a, **kw: calls.append(a)  # type: ignore[method-assign,assignment]
    seqs = sequences([[5, 6, 5, 6, 5]])
    proposal = proposer.propose(planned_requests(proposer, seqs, 2))
    assert proposal.tokens == [[6, 5]]
    assert not calls
    assert not proposal.forward_times


def test_point_masses_fill_looked_up_rows() -> None:
    tokens = [[4, 1], [2], [], [0, 3, 3]]
    draft_probs = torch.rand(4, 6)  # rows of requests 1 and 3, in order
    probs = with_point_masses(tokens, [1, 3], draft_probs)
    expected = torch.zeros(6, 6)
    expected[0, 4] = expected[1, 1] = 1.0
    expected[2] = draft_probs[0]
    expected[3:] = draft_probs[1:]
    torch.testing.assert_close(probs, expected, rtol=0, atol=0)


def test_hybrid_sampled_rows_carry_the_drafter_q(tiny_draft_dir: Path) -> None:
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=8)
    prompts = [[9, 10, 11, 9, 10], [40, 41, 42, 43]]
    proposer = hybrid(tiny_draft_dir, 2)
    proposal = proposer.propose(planned_requests(proposer, sequences(prompts, params), 2))
    alone = drafter(tiny_draft_dir).propose([DraftRequest(sequences([prompts[1]], params)[0], 2)])
    assert proposal.tokens == [[11, 9], alone.tokens[0]]
    assert proposal.draft_probs is not None
    assert alone.draft_probs is not None
    torch.testing.assert_close(proposal.draft_probs[2:], alone.draft_probs)
    assert proposal.draft_probs[0, 11] == 1
    assert proposal.draft_probs[1, 9] == 1
    assert proposal.draft_probs[:2].sum() == 2


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "ngram", "draft_confidence_threshold": 0.5}, "for methods"),
        ({"method": "draft_model", "draft_confidence_threshold": 1.0}, r"\[0, 1\)"),
        ({"method": "hybrid", "draft_confidence_threshold": -0.1}, r"\[0, 1\)"),
        ({"method": "hybrid", "draft_confidence_threshold": "high"}, "a number"),
        ({"method": "hybrid", "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "model": "x"}, "'model' is for methods"),
    ],
)
def test_bad_configs_are_refused(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse({"num_speculative_tokens": 3, **config})


@pytest.mark.parametrize("method", ["draft_model", "hybrid"])
@pytest.mark.parametrize("threshold", [0.0, 0.02])
def test_greedy_and_sampled_requests_share_a_step(
    tiny_model_dir: Path, tiny_draft_dir: Path, method: str, threshold: float
) -> None:
    """Greedy rows next to sampled ones, with different lookaheads (max_tokens) and rows that
    stop drafting at different steps: every draft still gets its q row, greedy rows give
    speculation off's tokens and seeded rows their seeded tokens."""
    prompts = prompts_with_repeats(8, seed=12)
    params = [
        GREEDY
        if i % 2 == 0
        else SamplingParams(temperature=1.0, seed=i, max_tokens=3 + i, ignore_eos=True)
        for i in range(8)
    ]
    config: dict[str, Any] = {
        "method": method,
        "model": str(tiny_draft_dir),
        "num_speculative_tokens": 4,
        "draft_confidence_threshold": threshold,
    }
    if method == "hybrid":
        config["prompt_lookup_min"] = 2
    llm = LLM(str(tiny_model_dir), speculative_config=config, **engine_kwargs())
    plain = LLM(str(tiny_model_dir), speculative_config=OFF, **engine_kwargs())
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert llm.llm_engine.stats.num_drafts > 0


def test_mixed_rows_get_one_q_row_per_draft(tiny_draft_dir: Path) -> None:
    sampled = SamplingParams(temperature=1.0, max_tokens=8)
    seqs = sequences([[5, 6, 7], [8, 9, 10, 11]])
    seqs[1].params = sampled
    proposal = drafter(tiny_draft_dir).propose([DraftRequest(seqs[0], 4), DraftRequest(seqs[1], 1)])
    assert [len(t) for t in proposal.tokens] == [4, 1]
    assert proposal.draft_probs is not None
    assert proposal.draft_probs.shape[0] == 5
    # the greedy row's q is one-hot on its draft
    assert proposal.draft_probs[:4].amax(-1).tolist() == [1.0] * 4
    assert proposal.draft_probs[torch.arange(4), proposal.tokens[0]].tolist() == [1.0] * 4


def expected_priced_length(products: list[float], threshold: float, price: float, most: int) -> int:
    """A priced chain: no drafts unless the first reaches the price, then on while the product
    reaches both the threshold and the price."""
    if products[0] < price:
        return 0
    return expected_length(products, max(threshold, price), most)


def test_priced_first_drafts_match_slow_reference(tiny_draft_dir: Path) -> None:
    """``row_price``: a first draft whose probability does not reach it is not made (nor is
    anything after it); a chain goes on while its product reaches the price too."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, int(rng.integers(2, 14))).tolist() for _ in range(10)]
    reference = [reference_drafts(tiny_draft_dir, p, K) for p in prompts]
    firsts = sorted(products[0] for _, products in reference)
    prices = [0.0, firsts[3] + 1e-7, float(np.median(firsts)), firsts[-1] + 1e-7]
    for threshold in (0.0, float(np.median([p[1] for _, p in reference]))):
        for price in prices:
            proposer = drafter(tiny_draft_dir, threshold)
            seqs = sequences(prompts)
            proposal = proposer.propose([DraftRequest(s, K, row_price=price) for s in seqs])
            lengths = []
            for (drafts, products), got in zip(reference, proposal.tokens, strict=True):
                length = expected_priced_length(products, threshold, price, K)
                assert got == drafts[:length], (threshold, price)
                lengths.append(length)
            made = sum(1 for n in lengths if n)
            assert made == {0: 10, 1: 6, 2: 5, 3: 0}[prices.index(price)]


def test_priced_unseeded_first_drafts_keep_the_target_distribution(tmp_path: Path) -> None:
    """On an unseeded random row a first draft kept for reaching the price is judged by q
    restricted to the tokens that reach it (what it was drawn from); a dropped one's token
    comes from the target alone: together, exactly the target's distribution (chi-square on
    the first token emitted; judged by the unrestricted q, the kept tokens are too likely)."""
    from scipy.stats import chisquare

    from specbatch.spec_decode.verification.chain import verify
    from tests.helpers import write_tiny_model

    vocab, n = 16, 20000
    draft_dir = write_tiny_model(tmp_path / "draft", seed=21, vocab_size=vocab)
    proposer = NetworkProposer(
        DraftModelNetwork(load_model(draft_dir)),
        num_blocks=8,
        block_size=BLOCK,
        generator=torch.Generator(),
    )
    params = SamplingParams(temperature=1.0, max_tokens=4)
    prompt = [3, 9, 4, 11, 7]
    seqs = [Sequence(i, str(i), 0, prompt, params, 0.0) for i in range(n)]
    for seq in seqs:  # one prompt, one cache: every sequence reads the same blocks
        seq.block_table = [0, 1, 2]
    q = PagedHarness(load_model(draft_dir), 8, BLOCK).forward([(0, prompt)])[0][-1].softmax(-1)
    price = float(q[:vocab].sort().values[vocab // 2])  # about half of the draws dropped
    proposal = proposer.propose([DraftRequest(s, 1, row_price=price) for s in seqs])
    kept = [i for i, t in enumerate(proposal.tokens) if t]
    assert 0.2 * n < len(kept) < 0.8 * n
    assert proposal.draft_probs is not None
    assert len(proposal.draft_probs) == len(kept)
    assert all(float(q[proposal.tokens[i][0]]) >= price - 1e-6 for i in kept)
    target = torch.randn(q.shape[0], generator=torch.Generator().manual_seed(4)) * 1.5
    target[vocab:] = float("-inf")
    logits = target.repeat(n + len(kept), 1)  # a row per draft and one after, per sequence
    rows = [
        s.sampling_row(d[:j])
        for s, d in zip(seqs, proposal.tokens, strict=True)
        for j in range(len(d) + 1)
    ]
    result = verify(
        logits, rows, proposal.tokens, proposal.draft_probs, torch.Generator().manual_seed(7)
    )
    first = [tokens[0] for tokens in result.tokens]  # the accepted draft or the correction
    expected = torch.softmax(target.double(), -1)[:vocab].numpy()
    expected *= n / expected.sum()
    observed = np.bincount(first, minlength=vocab)[:vocab]
    assert chisquare(observed, expected)[1] > 1e-3
