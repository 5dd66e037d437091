"""The engine's one handle on speculative decoding: who drafts how many, the drafts, the verdict.

Each step the engine hands over the sequences that will sample a token and how many draft slots
the scheduler reserved for each; the speculator asks the budget (``adaptive_k``) how many of
those slots each sequence should use, asks the proposer for that many drafts (batched over the
sequences), and after the target's forward turns the logits into the accepted drafts plus one
token per sequence. With speculation off (no proposer) it is the plain sampler.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceT

import torch

from specbatch.kernels.sampling import sample
from specbatch.sequence import Sequence
from specbatch.spec_decode.budget import SpeculationBudget
from specbatch.spec_decode.proposer import DraftRequest, Proposal, Proposer
from specbatch.spec_decode.rejection import VerifyResult, verify


class Speculator:
    """Drafts for a step's sampling sequences and verifies them against the target's logits."""

    def __init__(
        self,
        proposer: Proposer | None,
        budget: SpeculationBudget | None,
        generator: torch.Generator,
    ) -> None:
        self.proposer = proposer
        self.budget = budget
        self.generator = generator
        self._proposer_seconds = 0.0  # of the current step

    def propose(
        self, seqs: SequenceT[Sequence], slots: SequenceT[int], base_tokens: int
    ) -> Proposal:
        """Drafts for each sequence, at most its reserved ``slots`` (others: none); with a
        budget, as many of those slots as it gives the sequence this step. ``base_tokens`` is
        the size of the step's forward before drafts."""
        self._proposer_seconds = 0.0
        tokens: list[list[int]] = [[] for _ in seqs]
        wanted = [i for i, n in enumerate(slots) if n > 0]
        if self.proposer is None or not wanted:
            return Proposal(tokens)
        allowed = [slots[i] for i in wanted]
        if self.budget is not None:
            allowed = self.budget.allot([seqs[i].seq_id for i in wanted], allowed, base_tokens)
            kept = [(i, a) for i, a in zip(wanted, allowed, strict=True) if a]
            if not kept:
                return Proposal(tokens)
            wanted, allowed = [i for i, _ in kept], [a for _, a in kept]
        started = time.perf_counter()
        proposal = self.proposer.propose(
            [DraftRequest(seqs[i], a) for i, a in zip(wanted, allowed, strict=True)]
        )
        self._proposer_seconds = time.perf_counter() - started
        probs, row = proposal.draft_probs, 0
        q_rows: list[int] = []
        for i, drafted, most in zip(wanted, proposal.tokens, allowed, strict=True):
            tokens[i] = drafted[:most]  # a proposer may not exceed its slots: cut, q rows too
            q_rows += range(row, row + len(tokens[i]))
            row += len(drafted)
        if probs is not None and len(q_rows) < row:
            probs = probs[q_rows]
        return Proposal(tokens, probs)

    def verify(
        self, logits: torch.Tensor, seqs: SequenceT[Sequence], proposal: Proposal
    ) -> VerifyResult:
        """Accepted drafts and the one correction or bonus token per sequence; ``logits`` has
        ``len(drafts) + 1`` rows per sequence, in order."""
        if not any(proposal.tokens):  # the plain, non-speculative path
            rows = [seq.sampling_row() for seq in seqs]
            sampled = sample(logits, rows, self.generator).tolist()
            return VerifyResult([0] * len(seqs), [[t] for t in sampled])
        rows = [
            seq.sampling_row(drafted[:j])
            for seq, drafted in zip(seqs, proposal.tokens, strict=True)
            for j in range(len(drafted) + 1)
        ]
        return verify(logits, rows, proposal.tokens, proposal.draft_probs, self.generator)

    def observe_step(self, forward_tokens: int, seconds: float, num_drafts: int) -> None:
        """A finished step: its forward's size and its whole time (the proposer's included)."""
        if self.budget is not None:
            proposer = self._proposer_seconds
            self.budget.observe_step(forward_tokens, seconds - proposer, num_drafts, proposer)

    def on_verified(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """The target accepted ``num_accepted`` of the sequence's ``num_drafts`` drafts and the
        sequence's computed tokens cover them: proposers roll their own state back to it."""
        if num_drafts:
            seq.spec.record(num_drafts, num_accepted)
            if self.budget is not None:
                self.budget.observe_verify(seq.seq_id, num_drafts, num_accepted)
        if self.proposer is not None:
            self.proposer.on_verified(seq)

    def forget(self, seq: Sequence) -> None:
        """The sequence's cache is gone (finished, aborted, preempted): so is its draft state."""
        if self.proposer is not None:
            self.proposer.forget(seq)
        if self.budget is not None:
            self.budget.forget(seq.seq_id)
