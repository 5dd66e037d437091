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

Everything runs on padded ``[S, k_max + 1]`` tensors on the logits' device; the host sees one
transfer per step (the accepted counts and tokens). Random sequences draw ``k_max + 1``
uniforms each from the engine's generator: column j < k decides draft j, column ``k_max`` the
final token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass
class VerifyResult:
    num_accepted: list[int]  # drafts accepted per sequence
    tokens: list[list[int]]  # accepted drafts plus the correction or bonus token
    # For a step with trees: the accepted path's draft indices per sequence, root-most first
    # (None: chains, whose first num_accepted drafts are the path).
    accepted_nodes: list[list[int]] | None = None

    def path(self, s: int) -> list[int]:
        """Sequence ``s``'s accepted drafts as indices into its drafts."""
        if self.accepted_nodes is None:
            return list(range(self.num_accepted[s]))
        return self.accepted_nodes[s]


@dataclass
class _Layout:
    """Where each sequence's rows and drafts are, padded to ``[S, k_max (+ 1)]``."""

    num_drafts: torch.Tensor  # [S]
    drafts: torch.Tensor  # [S, k_max], -1 past a sequence's drafts
    rows: torch.Tensor  # [S, k_max + 1] target row of (s, j), clamped into the sequence
    q_rows: torch.Tensor  # [S, k_max] draft-probability row of (s, j), clamped
    k_max: int

    @classmethod
    def of(cls, drafts: Sequence[Sequence[int]], device: torch.device) -> _Layout:
        counts = [len(d) for d in drafts]
        k_max = max(counts, default=0)
        num = torch.tensor(counts, dtype=torch.long, device=device)
        padded = torch.full((len(drafts), k_max), -1, dtype=torch.long)
        for s, d in enumerate(drafts):
            padded[s, : len(d)] = torch.tensor(list(d), dtype=torch.long)
        starts = torch.cumsum(num + 1, 0) - (num + 1)
        q_starts = torch.cumsum(num, 0) - num
        j = torch.arange(k_max + 1, device=device)
        rows = starts[:, None] + torch.minimum(j[None, :], num[:, None])
        q_rows = q_starts[:, None] + torch.minimum(j[None, :k_max], (num - 1).clamp(min=0)[:, None])
        q_rows = q_rows.clamp(max=max(sum(counts) - 1, 0))  # sequences without drafts
        return cls(num, padded.to(device), rows, q_rows, k_max)


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
    device = logits.device
    t = SamplingTensors.build(rows, logits.shape[1], device)
    if t.all_greedy:  # the targets to the host at once (the step's one transfer)
        return greedy_chains(greedy_tokens(logits, t).tolist(), drafts)
    layout = _Layout.of(drafts, device)
    p = target_probs(logits, t)
    first_rows, total = [], 0
    for d in drafts:
        first_rows.append(total)
        total += len(d) + 1
    random_flags = [
        not (rows[i].params.greedy or rows[i].params.seed is not None) for i in first_rows
    ]
    random_seq = torch.tensor(random_flags, dtype=torch.bool, device=device)
    # Per row: the argmax, or for seeded random rows their Gumbel-max sample.
    targets = with_seeded_samples(row_argmax(p), p, rows)
    accepted, final = _match(layout, targets[layout.rows])
    if any(random_flags):  # known on the host: no wait on the device
        r_accepted, r_final = _rejection(p, layout, draft_probs, generator)
        accepted = torch.where(random_seq, r_accepted, accepted)
        final = torch.where(random_seq, r_final, final)
    return _result(layout, accepted, final)


def greedy_chains(targets: Sequence[int], drafts: Sequence[Sequence[int]]) -> VerifyResult:
    """Greedy rows' verification on the host: each sequence's drafts accepted while they equal
    its rows' argmax ``targets`` (``len(drafts[s]) + 1`` of them per sequence, in order), then
    the next argmax. What :func:`_match` computes on padded tensors, without them: at batch 1
    the tensors' layout and match took ~0.25 ms of a verify (1 ms against cold caches in the
    engine), this loop a few us."""
    accepted, tokens, row = [], [], 0
    for d in drafts:
        n = 0
        while n < len(d) and d[n] == targets[row + n]:
            n += 1
        accepted.append(n)
        tokens.append([*d[:n], targets[row + n]])
        row += len(d) + 1
    return VerifyResult(accepted, tokens)


def _match(layout: _Layout, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts accepted while they equal the targets; the final token is the next target."""
    k = layout.k_max
    valid = torch.arange(k, device=targets.device)[None, :] < layout.num_drafts[:, None]
    equal = (layout.drafts == targets[:, :k]) & valid
    accepted = equal.long().cumprod(1).sum(1)
    final = targets.gather(1, accepted[:, None]).squeeze(1)
    return accepted, final


def _rejection(
    p: torch.Tensor,
    layout: _Layout,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Modified rejection sampling for every sequence (callers keep the random ones)."""
    k, device = layout.k_max, p.device
    uniforms = torch.rand(
        len(layout.num_drafts),
        k + 1,
        dtype=torch.float64,
        generator=generator,
        device=generator.device,
    ).to(device)
    drafts = layout.drafts.clamp(min=0)
    p_draft = p[layout.rows[:, :k], drafts].double()
    q_draft = torch.ones_like(p_draft)
    if draft_probs is not None and k:
        q_draft = draft_probs[layout.q_rows, drafts].double()
    valid = torch.arange(k, device=device)[None, :] < layout.num_drafts[:, None]
    passed = (uniforms[:, :k] * q_draft < p_draft) & valid
    accepted = passed.long().cumprod(1).sum(1)
    final_rows = p[layout.rows.gather(1, accepted[:, None]).squeeze(1)]
    rejected = accepted < layout.num_drafts
    if k:  # computed for every row (no wait on the device), used where a draft was rejected
        position = accepted.clamp(max=k - 1)[:, None]
        rejected_token = drafts.gather(1, position).squeeze(1)
        if draft_probs is None:
            residual = final_rows.scatter(1, rejected_token[:, None], 0.0)
        else:
            q_row = draft_probs[layout.q_rows.gather(1, position).squeeze(1)]
            residual = (final_rows - q_row).clamp(min=0.0)
        # p == q up to rounding makes the residual empty: the rejection was an artefact
        usable = rejected & (residual.sum(-1) > 0)
        final_rows = torch.where(usable[:, None], residual, final_rows)
    final = inverse_cdf(final_rows, uniforms[:, k])
    return accepted, final


def _result(layout: _Layout, accepted: torch.Tensor, final: torch.Tensor) -> VerifyResult:
    # The one device-to-host transfer of the step.
    packed = torch.cat([layout.drafts, accepted[:, None], final[:, None]], dim=1).tolist()
    k = layout.k_max
    tokens = [row[: row[k]] + [row[k + 1]] for row in packed]
    return VerifyResult([row[k] for row in packed], tokens)
