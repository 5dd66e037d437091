"""A proposer that knows the answer: for tests and benchmarks of the verify path.

It drafts the target's known greedy continuation, corrupting each draft token with probability
``1 - acceptance``, so greedy verification accepts a controlled, random number of drafts. This
isolates the engine's speculation machinery (batched verify, rollback, metrics) from draft
quality, and lets a benchmark hold the acceptance rate at a chosen value.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from specbatch.spec_decode.proposer import DraftRequest, Proposal, Proposer


class OracleProposer(Proposer):
    """Drafts ``continuations[request_id]`` (the greedy output) with random corruption."""

    def __init__(
        self,
        continuations: Mapping[str, Sequence[int]],
        acceptance: float,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        self.continuations = continuations
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.random = random.Random(seed)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        tokens = []
        for r in requests:
            truth = self.continuations.get(r.seq.request_id, ())
            start = r.seq.num_output_tokens
            drafts = list(truth[start : start + r.max_drafts])
            for j, token in enumerate(drafts):
                if self.random.random() >= self.acceptance:
                    drafts[j] = (token + 1 + self.random.randrange(self.vocab_size - 1)) % (
                        self.vocab_size
                    )
            tokens.append(drafts)
        return Proposal(tokens)
