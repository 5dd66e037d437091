"""Verification: which drafts survive, and the one extra token, batched over a step.

Per sequence with drafts ``d_1..d_k`` the target gives ``k + 1`` rows; row ``j`` is the
distribution p_j of the token after ``d_1..d_j`` (penalties see the drafts as history), processed
exactly as the plain sampler would (``target_probs``). Then:

* **random rows, draft distribution q given** (Leviathan et al. 2023, Chen et al. 2023): accept
  ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection sample from
  ``norm(max(0, p_j - q_j))``; if all k pass, sample the bonus token from ``p_{k+1}``;
* **random rows, no q** (n-gram drafts are point masses): accept with probability
  ``p_j(d_j)``, else sample from ``p_j`` with ``d_j`` removed and renormalised;
* **greedy rows**: p is one-hot on the argmax, so the same rule reduces to "accept while the
  draft equals the target's argmax, then emit the argmax";
* **seeded rows** use the coupled rule: the target's token at each position is the Gumbel-max
  sample ``argmax(log p_j + g(seed, position))``; drafts are accepted while they equal it and the
  first mismatch is replaced by it. Every emitted token is then exactly the target's own seeded
  sample, so a seeded request's output does not depend on k, the proposer or its batch-mates.

Each rule emits tokens distributed exactly as sampling the target alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specbatch.kernels.sampling import (
    SamplingRow,
    SamplingTensors,
    apply_penalties,
    gumbel_argmax,
    gumbel_noise,
    inverse_cdf,
    target_probs,
)


@dataclass
class VerifyResult:
    num_accepted: list[int]  # drafts accepted per sequence
    tokens: list[list[int]]  # accepted drafts plus the correction or bonus token


def verify(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> VerifyResult:
    """Accept/reject every sequence's drafts against its target rows.

    ``logits``/``rows`` hold ``len(drafts[s]) + 1`` rows per sequence, sequence after sequence;
    ``draft_probs`` holds one q row per draft in the same order, or is None (point masses).
    """
    starts = _starts([len(d) + 1 for d in drafts])
    t = SamplingTensors.build(rows, logits.shape[1], logits.device)
    if t.all_greedy:
        targets = apply_penalties(logits.float(), t).argmax(-1).tolist()
        return _match_targets(drafts, starts, targets)
    p = target_probs(logits, t)
    accepted: list[int] = [0] * len(drafts)
    tokens: list[list[int]] = [[] for _ in drafts]
    random_seqs = []
    for s, draft in enumerate(drafts):
        params = rows[starts[s]].params
        if params.greedy or params.seed is not None:
            targets = [
                _deterministic_token(p[starts[s] + j], rows[starts[s] + j])
                for j in range(len(draft) + 1)
            ]
            m = _leading_matches(draft, targets)
            accepted[s], tokens[s] = m, list(draft[:m]) + [targets[m]]
        else:
            random_seqs.append(s)
    if random_seqs:
        q_starts = _starts([len(d) for d in drafts])
        _rejection_sample(
            p, drafts, draft_probs, starts, q_starts, random_seqs, generator, accepted, tokens
        )
    return VerifyResult(accepted, tokens)


def _starts(lengths: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def _leading_matches(draft: Sequence[int], targets: Sequence[int]) -> int:
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return m


def _match_targets(
    drafts: Sequence[Sequence[int]], starts: list[int], targets: list[int]
) -> VerifyResult:
    accepted, tokens = [], []
    for s, draft in enumerate(drafts):
        row_targets = targets[starts[s] : starts[s] + len(draft) + 1]
        m = _leading_matches(draft, row_targets)
        accepted.append(m)
        tokens.append(list(draft[:m]) + [row_targets[m]])
    return VerifyResult(accepted, tokens)


def _deterministic_token(probs: torch.Tensor, row: SamplingRow) -> int:
    if row.params.greedy or row.params.seed is None:
        return int(probs.argmax())
    noise = gumbel_noise(row.params.seed, row.position, probs.shape[0], probs.device)
    return int(gumbel_argmax(probs, noise))


def _rejection_sample(
    p: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    starts: list[int],
    q_starts: list[int],
    seqs: list[int],
    generator: torch.Generator,
    accepted: list[int],
    tokens: list[list[int]],
) -> None:
    """Modified rejection sampling for unseeded random sequences (fills accepted/tokens)."""
    uniforms = torch.rand(
        sum(len(drafts[s]) + 1 for s in seqs), dtype=torch.float64, generator=generator
    ).tolist()
    flat_rows = [starts[s] + j for s in seqs for j in range(len(drafts[s]))]
    flat_tokens = [t for s in seqs for t in drafts[s]]
    p_draft = p[flat_rows, flat_tokens].double().tolist() if flat_rows else []
    q_draft = [1.0] * len(flat_rows)
    if draft_probs is not None and flat_rows:
        q_rows = [q_starts[s] + j for s in seqs for j in range(len(drafts[s]))]
        q_draft = draft_probs[q_rows, flat_tokens].double().tolist()
    finals, final_uniforms, cursor, flat = [], [], 0, 0
    for s in seqs:
        k = len(drafts[s])
        m = 0
        while m < k and uniforms[cursor + m] * q_draft[flat + m] < p_draft[flat + m]:
            m += 1
        row = p[starts[s] + m]
        if m < k:
            row = _residual(
                row, drafts[s][m], None if draft_probs is None else draft_probs[q_starts[s] + m]
            )
        finals.append(row)
        final_uniforms.append(uniforms[cursor + k])
        accepted[s] = m
        tokens[s] = list(drafts[s][:m])
        cursor += k + 1
        flat += k
    picked = inverse_cdf(
        torch.stack(finals), torch.tensor(final_uniforms, dtype=torch.float64)
    ).tolist()
    for s, token in zip(seqs, picked, strict=True):
        tokens[s].append(int(token))


def _residual(p_row: torch.Tensor, rejected: int, q_row: torch.Tensor | None) -> torch.Tensor:
    """``norm(max(0, p - q))``; a point-mass q removes the rejected token from p."""
    if q_row is None:
        residual = p_row.clone()
        residual[rejected] = 0.0
    else:
        residual = (p_row - q_row).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:
        return p_row  # p == q up to rounding: rejection was a rounding artefact
    return residual
