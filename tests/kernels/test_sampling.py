"""Batched sampling against per-row references and statistical tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specbatch.kernels.sampling import (
    SamplingRow,
    SamplingTensors,
    gumbel_argmax,
    gumbel_noise,
    row_argmax,
    sample,
    target_probs,
)
from specbatch.sampling_params import SamplingParams

V = 40


def reference_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The obvious per-row version of the target distribution (vLLM's order of processing)."""
    p = row.params
    x = logits.double().clone()
    for t, bias in (p.logit_bias or {}).items():
        x[t] += bias
    for t in row.banned_token_ids:
        x[t] = -math.inf
    seen_out = set(row.output_ids)
    seen = seen_out | set(row.prompt_ids)
    for tok in range(len(x)):
        if tok in seen and p.repetition_penalty != 1.0:
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
        count = list(row.output_ids).count(tok)
        x[tok] -= p.frequency_penalty * count
        if tok in seen_out:
            x[tok] -= p.presence_penalty
    if p.greedy:
        out = torch.zeros_like(x)
        out[int(x.argmax())] = 1.0
        return out
    x = x / p.temperature
    probs = torch.softmax(x, 0)
    if p.min_p > 0:
        x[probs < p.min_p * probs.max()] = -math.inf
    order = sorted(range(len(x)), key=lambda t: -float(x[t]))
    if p.top_k:
        kth = float(x[order[p.top_k - 1]])
        x[x < kth] = -math.inf
    if p.top_p < 1.0:
        probs = torch.softmax(x, 0)
        mass = 0.0
        for tok in order:
            if mass >= p.top_p:
                x[tok] = -math.inf
            mass += float(probs[tok])
    return torch.softmax(x, 0)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05),
    SamplingParams(
        temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3
    ),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=2.0),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=6, logit_bias={1: 5.0, 2: -100.0}),
]


def _rows(rng: np.random.Generator) -> list[SamplingRow]:
    rows = []
    for i, p in enumerate(PARAMS):
        prompt = rng.integers(0, V, 6).tolist()
        output = rng.integers(0, V, int(rng.integers(0, 8))).tolist()
        banned = (3, 4) if i == 0 else ()
        rows.append(SamplingRow(p, prompt, output, position=10 + i, banned_token_ids=banned))
    return rows


def test_target_probs_match_reference() -> None:
    rng = np.random.default_rng(0)
    rows = _rows(rng)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(0)) * 3
    got = target_probs(logits, SamplingTensors.build(rows, V, torch.device("cpu")))
    for i, row in enumerate(rows):
        expected = reference_probs(logits[i], row).float()
        torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-6, msg=f"row {i}")


def test_sampled_tokens_stay_in_the_allowed_set() -> None:
    rng = np.random.default_rng(1)
    rows = _rows(rng)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(1)) * 3
    allowed = [reference_probs(logits[i], r) > 0 for i, r in enumerate(rows)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        tokens = sample(logits, rows, generator)
        for i, tok in enumerate(tokens.tolist()):
            assert allowed[i][tok], f"row {i} sampled disallowed token {tok}"


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_empirical_frequencies_match_softmax(seeded: bool, temperature: float) -> None:
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 1.5
    expected = torch.softmax(logits[0].double() / temperature, 0).numpy()
    expected /= expected.sum()
    n = 20000
    if seeded:
        # one draw per (seed, position): different seeds give independent samples
        rows = [
            SamplingRow(SamplingParams(temperature=temperature, seed=s), [], [], 0)
            for s in range(n)
        ]
    else:
        rows = [SamplingRow(SamplingParams(temperature=temperature), [], [], 0)] * n
    tokens = sample(logits.expand(n, -1), rows, torch.Generator().manual_seed(7))
    counts = np.bincount(tokens.numpy(), minlength=12)
    _, p_value = chisquare(counts, expected * n)
    assert p_value > 1e-3


def test_seeded_rows_ignore_their_batch_mates() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    seeded = SamplingRow(SamplingParams(temperature=1.0, seed=42), [], [], position=17)
    other = SamplingRow(SamplingParams(temperature=1.0), [], [], position=3)
    alone = sample(logits[1:2], [seeded], torch.Generator().manual_seed(0))
    batched = sample(logits, [other, seeded, other], torch.Generator().manual_seed(99))
    assert int(alone[0]) == int(batched[1])


def test_gumbel_noise_depends_only_on_seed_and_position() -> None:
    a = gumbel_noise(5, 9, V, torch.device("cpu"))
    assert torch.equal(a, gumbel_noise(5, 9, V, torch.device("cpu")))
    assert not torch.equal(a, gumbel_noise(5, 10, V, torch.device("cpu")))
    probs = torch.zeros(V)
    probs[7] = 1.0
    assert int(gumbel_argmax(probs, a)) == 7  # zero-probability tokens can never win


def test_greedy_ties_and_empty_batch() -> None:
    assert sample(torch.zeros(0, V), [], torch.Generator()).numel() == 0
    logits = torch.zeros(1, V)
    logits[0, 11] = 5.0
    row = SamplingRow(SamplingParams(temperature=0.0), [], [], 0)
    assert int(sample(logits, [row], torch.Generator())[0]) == 11


def test_row_tensors_match_per_row_loops() -> None:
    """Counts, prompt mask, bans and bias built in one upload equal per-row loops (repeated
    ids accumulate, ids outside the vocabulary are ignored, rows without settings stay zero)."""
    rng = np.random.default_rng(3)
    vocab = 30
    for _ in range(20):
        rows = []
        for _ in range(int(rng.integers(1, 6))):
            params = SamplingParams(
                temperature=1.0,
                repetition_penalty=float(rng.choice([1.0, 1.5])),
                presence_penalty=float(rng.choice([0.0, 0.5])),
                logit_bias={int(t): float(rng.normal()) for t in rng.integers(0, 40, 3)}
                if rng.random() < 0.5
                else None,
            )
            rows.append(
                SamplingRow(
                    params,
                    rng.integers(0, 40, int(rng.integers(0, 8))).tolist(),
                    rng.integers(0, 40, int(rng.integers(0, 8))).tolist(),
                    position=5,
                    banned_token_ids=tuple(rng.integers(0, 40, int(rng.integers(0, 3))).tolist()),
                )
            )
        t = SamplingTensors.build(rows, vocab, torch.device("cpu"))
        counts = torch.zeros(len(rows), vocab)
        prompt = torch.zeros(len(rows), vocab, dtype=torch.bool)
        banned = torch.zeros(len(rows), vocab, dtype=torch.bool)
        bias = torch.zeros(len(rows), vocab)
        for i, row in enumerate(rows):
            for token in row.output_ids:
                if row.params.has_penalties and token < vocab:
                    counts[i, token] += 1
            for token in row.prompt_ids:
                if row.params.repetition_penalty != 1.0 and token < vocab:
                    prompt[i, token] = True
            for token in row.banned_token_ids:
                if token < vocab:
                    banned[i, token] = True
            for token, value in (row.params.logit_bias or {}).items():
                if token < vocab:
                    bias[i, token] = value
        penalised = any(r.params.has_penalties for r in rows)
        if penalised:
            assert t.output_counts is not None
            assert t.prompt_mask is not None
            assert torch.equal(t.output_counts, counts)
            assert torch.equal(t.prompt_mask, prompt)
        if any(r.banned_token_ids for r in rows):
            assert t.banned is not None
            assert torch.equal(t.banned, banned)
        else:
            assert t.banned is None
        if any(r.params.logit_bias for r in rows):
            assert t.bias is not None
            assert torch.equal(t.bias, bias)
        else:
            assert t.bias is None


def _peaked_logits(rows: int, vocab: int, spreads: list[float], seed: int) -> torch.Tensor:
    """Zipf-like rows: a few likely tokens and a long tail, flatter as the spread grows."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    out = torch.empty(rows, vocab)
    for r in range(rows):
        row = -torch.log(rank) * (4.0 / spreads[r % len(spreads)])
        out[r] = row[torch.randperm(vocab, generator=gen)] + 0.1 * torch.randn(vocab, generator=gen)
    return out


def test_candidate_top_k_top_p_equals_sorting_every_row() -> None:
    """The fast path (candidates in tiers, sorting only rows whose sets reach past them) keeps
    exactly the tokens the sort-everything version keeps, on rows that end in each tier."""
    from specbatch.kernels import sampling

    vocab = 20000
    spreads = [1.0, 3.0, 6.0, 12.0]  # nucleus of a few, hundreds, thousands, most tokens
    logits = _peaked_logits(24, vocab, spreads, seed=0)
    top_k = torch.tensor([[vocab, 5, 300, 256, 5000, vocab][i % 6] for i in range(24)])
    top_p = torch.tensor([[0.9, 1.0, 0.95, 0.5, 0.999, 0.8][i % 6] for i in range(24)])
    tiers = set()
    original = sampling._within_candidates

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        values, done = original(*args, **kwargs)  # type: ignore[arg-type]
        tiers.add((args[1], bool(done.all())))
        return values, done

    sampling._within_candidates = spy  # type: ignore[assignment]
    try:
        for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
            fast = sampling._top_k_top_p(logits, k, p)
            slow = sampling._top_k_top_p_sorted(logits, k, p)
            assert torch.equal(fast == float("-inf"), slow == float("-inf"))
            kept = fast != float("-inf")
            assert torch.equal(fast[kept], logits[kept])
    finally:
        sampling._within_candidates = original  # type: ignore[assignment]
    assert (256, False) in tiers  # some rows went on to the next tier
    assert (4096, False) in tiers  # and some were sorted whole


def test_candidate_top_k_top_p_rows_do_not_depend_on_the_batch() -> None:
    from specbatch.kernels.sampling import _top_k_top_p

    logits = _peaked_logits(8, 20000, [1.0, 3.0, 6.0, 12.0], seed=1)
    top_k = torch.tensor([20000, 40, 20000, 300, 20000, 20000, 7, 20000])
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.9, 0.99, 0.7, 0.9, 1.0])
    together = _top_k_top_p(logits, top_k, top_p)
    for r in range(8):
        alone = _top_k_top_p(logits[r : r + 1], top_k[r : r + 1], top_p[r : r + 1])
        assert torch.equal(alone, together[r : r + 1]), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_argmax_is_torchs_argmax(dtype: torch.dtype) -> None:
    """The numpy path (float CPU tensors) against torch's argmax: random rows, ties (the first
    wins), -inf rows, NaN (the first NaN wins), one row, no rows, a strided view."""
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(7, 1000, generator=g),
        torch.randint(0, 3, (6, 50), generator=g).float(),  # many ties
        torch.full((2, 9), float("-inf")),
        torch.randn(1, 49152, generator=g),
        torch.zeros(0, 16),
        torch.randn(8, 40, generator=g)[::2, 5:],
    ]
    with_nan = torch.randn(4, 30, generator=g)
    with_nan[1, 7] = with_nan[1, 20] = with_nan[3, 0] = float("nan")
    cases.append(with_nan)
    for x in cases:
        x = x.to(dtype)
        got = row_argmax(x)
        assert got.dtype == torch.long
        assert torch.equal(got, x.argmax(-1))
