"""The batched rejection sampler against an obvious per-sequence reference, plus statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specbatch.kernels.sampling import SamplingRow, gumbel_argmax, gumbel_noise
from specbatch.sampling_params import SamplingParams
from specbatch.spec_decode.verification.chain import _Layout, _match, _result, greedy_chains, verify

V = 12
RANDOM = SamplingParams(temperature=1.0)


def reference(
    p_rows: list[torch.Tensor],
    drafts: list[int],
    q_rows: list[torch.Tensor] | None,
    uniforms: list[float],
) -> list[int]:
    """Leviathan et al.'s algorithm for one sequence: uniforms[j] decides draft j, the last
    uniform samples the final token."""
    out = []
    for j, d in enumerate(drafts):
        q = 1.0 if q_rows is None else float(q_rows[j][d])
        if uniforms[j] * q < float(p_rows[j][d]):
            out.append(d)
            continue
        if q_rows is None:
            residual = p_rows[j].double().clone()
            residual[d] = 0.0
        else:
            residual = (p_rows[j].double() - q_rows[j].double()).clamp(min=0)
        if float(residual.sum()) <= 0:
            residual = p_rows[j].double()
        return [*out, _pick(residual, uniforms[-1])]
    return [*out, _pick(p_rows[len(drafts)].double(), uniforms[-1])]


def _pick(weights: torch.Tensor, u: float) -> int:
    target = u * float(weights.sum())
    total = 0.0
    for token, w in enumerate(weights.tolist()):
        total += w
        if total > target:
            return token
    return len(weights) - 1


def random_dist(gen: torch.Generator, kind: str) -> torch.Tensor:
    if kind == "one-hot":
        row = torch.zeros(V)
        row[int(torch.randint(0, V, (1,), generator=gen))] = 1.0
        return row
    row = torch.rand(V, generator=gen) ** 3
    if kind == "sparse":
        row[torch.rand(V, generator=gen) < 0.5] = 0.0
        row[0] += 0.01
    return row / row.sum()


@pytest.mark.parametrize("point_mass", [False, True])
def test_matches_reference_on_random_rows(point_mass: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    kinds = ["dense", "sparse", "one-hot"]
    drafts, p_rows, q_rows = [], [], []
    for s in range(60):
        k = s % 5
        p_rows.append([random_dist(gen, kinds[(s + j) % 3]) for j in range(k + 1)])
        q_rows.append([random_dist(gen, kinds[(s + 2 * j) % 3]) for j in range(k)])
        if s % 7 == 0:
            q_rows[-1] = [row.clone() for row in p_rows[-1][:k]]  # q == p: accept everything
        drafts.append([int(torch.multinomial(q, 1, generator=gen)) for q in q_rows[-1]])
    logits = torch.stack([row for rows in p_rows for row in rows]).log()
    rows = [SamplingRow(RANDOM, [], [], 0) for _ in range(len(logits))]
    q = None if point_mass else torch.stack([r for rows in q_rows for r in rows])
    result = verify(logits, rows, drafts, q, torch.Generator().manual_seed(5))

    stream = torch.Generator().manual_seed(5)
    # u[s, j] decides draft j of sequence s; u[s, k_max] samples its final token
    k_max = max(len(d) for d in drafts)
    uniforms = torch.rand(len(drafts), k_max + 1, dtype=torch.float64, generator=stream).tolist()
    for s, draft in enumerate(drafts):
        expected = reference(p_rows[s], draft, None if point_mass else q_rows[s], uniforms[s])
        assert result.tokens[s] == expected, f"sequence {s}"
        assert result.num_accepted[s] == len(expected) - 1


def test_edge_cases_all_rejected_and_all_accepted() -> None:
    p = torch.full((3, V), 1.0 / V)
    p_zero = p.clone()
    p_zero[:, 5] = 0.0
    p_zero /= p_zero.sum(-1, keepdim=True)
    rows = [SamplingRow(RANDOM, [], [], 0)] * 3
    # drafts the target gives probability 0: always rejected, never emitted
    rejected = verify(p_zero.log(), rows, [[5, 5]], None, torch.Generator())
    assert rejected.num_accepted == [0]
    assert rejected.tokens[0][0] != 5
    # q == p: every draft accepted and a bonus token appended
    accepted = verify(p.log(), rows, [[1, 2]], p[:2].clone(), torch.Generator())
    assert accepted.num_accepted == [2]
    assert accepted.tokens[0][:2] == [1, 2]
    assert len(accepted.tokens[0]) == 3


def test_greedy_rows_accept_while_drafts_equal_the_argmax() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(-1).tolist()
    greedy = [SamplingRow(SamplingParams(temperature=0.0), [], [], 0)] * 4
    result = verify(
        logits, greedy, [[argmax[0], argmax[1], (argmax[2] + 1) % V]], None, torch.Generator()
    )
    assert result.num_accepted == [2]
    assert result.tokens == [[argmax[0], argmax[1], argmax[2]]]


def test_seeded_rows_emit_the_targets_own_seeded_samples() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=99)
    rows = [SamplingRow(params, [], [], 40 + j) for j in range(4)]
    probs = logits.softmax(-1)
    own = [
        int(gumbel_argmax(probs[j], gumbel_noise(99, 40 + j, V, torch.device("cpu"))))
        for j in range(4)
    ]
    for drafts in ([own[0], own[1], own[2]], [own[0], (own[1] + 1) % V, own[2]], [0, 0, 0]):
        result = verify(logits, rows, [drafts], torch.full((3, V), 1.0 / V), torch.Generator())
        m = result.num_accepted[0]
        assert result.tokens[0] == own[: m + 1]


@pytest.mark.parametrize("point_mass", [False, True])
def test_emitted_tokens_follow_the_target_distribution(point_mass: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    p = torch.stack([random_dist(gen, "dense") for _ in range(3)])
    q = torch.stack([random_dist(gen, "dense") for _ in range(2)])
    n = 20000
    drafts = [[int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)] for _ in range(n)]
    logits = p.log().repeat(n, 1)
    rows = [SamplingRow(RANDOM, [], [], 0)] * len(logits)
    result = verify(
        logits,
        rows,
        drafts,
        None if point_mass else q.repeat(n, 1),
        torch.Generator().manual_seed(0),
    )
    first = np.bincount([t[0] for t in result.tokens], minlength=V)
    assert chisquare(first, p[0].double().numpy() * n / p[0].double().sum().item())[1] > 1e-3
    second = [t[1] for t in result.tokens if len(t) > 1]
    counts = np.bincount(second, minlength=V)
    expected = p[1].double().numpy()
    assert chisquare(counts, expected / expected.sum() * len(second))[1] > 1e-3


def test_sequences_without_drafts_mixed_with_drafted_ones() -> None:
    gen = torch.Generator().manual_seed(9)
    p = torch.stack([random_dist(gen, "dense") for _ in range(5)])
    q = torch.stack([random_dist(gen, "dense") for _ in range(2)])
    rows = [SamplingRow(RANDOM, [], [], 0)] * 5
    # sequence 0: no drafts (1 row); sequence 1: two drafts (3 rows); sequence 2: none, last
    result = verify(p.log(), rows, [[], [1, 2], []], q, torch.Generator())
    assert len(result.tokens) == 3
    assert result.num_accepted[0] == result.num_accepted[2] == 0
    assert len(result.tokens[0]) == len(result.tokens[2]) == 1


def test_greedy_chains_on_the_host_equal_the_padded_tensors_match() -> None:
    """The host loop against the padded-tensor rule it replaced for greedy steps, on random
    batches: sequences without drafts, every draft right, none right, the last one wrong."""
    rng = np.random.default_rng(7)
    vocab = 6  # small: drafts often equal their targets
    for _ in range(300):
        counts = rng.integers(0, 6, rng.integers(0, 5)).tolist()
        targets = rng.integers(0, vocab, sum(counts) + len(counts)).tolist()
        drafts, row = [], 0
        for count in counts:
            right = targets[row : row + count]
            wrong = rng.integers(0, vocab, count).tolist()
            mix = rng.random(count) < rng.choice([0.0, 0.7, 1.0])
            drafts.append([r if m else w for r, w, m in zip(right, wrong, mix, strict=True)])
            row += count + 1
        got = greedy_chains(targets, drafts)
        layout = _Layout.of(drafts, torch.device("cpu"))
        accepted, final = _match(layout, torch.tensor(targets, dtype=torch.long)[layout.rows])
        expected = _result(layout, accepted, final)
        assert got.num_accepted == expected.num_accepted
        assert got.tokens == expected.tokens
