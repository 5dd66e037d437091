"""A separate, smaller draft model with its own paged KV cache on the target's block tables.

The draft cache has the target's block ids and block size but its own tensors, so the target's
allocation (with its lookahead slots) governs both. Per sequence the proposer remembers how many
leading tokens its cache holds. A step first *catches up* on the tokens it has not seen (after a
verify: the last accepted draft and/or the correction token, 1-2 tokens; for a new sequence its
whole prompt) and draws the first draft from the last row; then it runs ``k - 1`` single-token
forwards, each one batched over every sequence that still wants drafts. With a confidence
threshold a sequence stops early, after the draft that brings the draft's probability that all
its drafts so far are right (the product of its probabilities of the tokens it drafted) below
it: one more would probably be rejected and cost a draft forward and a verify slot. (The draft
that crossed it is kept: its forward is paid, and a verify slot is cheap.) After
verification the valid prefix shrinks to the accepted tokens (``on_verified``): that is the
draft's rollback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specbatch.cache.kv_tensors import allocate_kv_caches
from specbatch.kernels.sampling import (
    SamplingRow,
    SamplingTensors,
    apply_penalties,
    greedy_tokens,
    sample_rows,
    target_probs,
)
from specbatch.models.llama import LlamaForCausalLM
from specbatch.runner.flat_batch import TokenRun, flatten
from specbatch.runner.model_runner import ModelRunner
from specbatch.sequence import Sequence
from specbatch.spec_decode.proposer import DraftRequest, Proposal, Proposer

if TYPE_CHECKING:  # triton is optional: only CUDA engines build graphs
    from specbatch.runner.cuda_graphs import CudaGraphRunner

MAX_FORWARD_TIMES = 64


class DraftModelProposer(Proposer):
    """Drafts with a small model, sampling each draft from its processed distribution q."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        generator: torch.Generator,
        confidence_threshold: float = 0.0,
        capture_graphs: Callable[[], CudaGraphRunner | None] | None = None,
    ) -> None:
        """``capture_graphs`` builds CUDA graphs for the single-token draft forwards; it is
        called once the draft's KV cache is bound (graphs capture the cache's addresses)."""
        self.model = model
        self.confidence_threshold = confidence_threshold
        self.block_size = block_size
        self.generator = generator
        model.bind_kv_caches(
            allocate_kv_caches(model.config, num_blocks, block_size, model.dtype, model.device)
        )
        self.runner = ModelRunner(model, block_size, capture_graphs() if capture_graphs else None)
        self._computed: dict[int, int] = {}  # seq_id -> leading tokens held by the draft cache
        self.num_forwards = 0  # batched draft forwards run so far (for cost accounting)
        self._forward_times: list[tuple[int, float]] = []  # (rows, seconds) not yet taken

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        runs = []
        for r in requests:
            start = self._computed.get(r.seq.seq_id, 0)
            runs.append(TokenRun(r.seq.token_ids[start:], start, r.seq.block_table))
        active = list(range(len(requests)))
        confidence = [1.0] * len(requests)  # the draft's P(every draft so far is accepted)
        # q for every draft once any row samples: the verify needs a row per draft token
        keep_probs = any(not r.seq.params.greedy for r in requests)
        for step in range(max(r.max_drafts for r in requests)):
            started = time.perf_counter()
            batch = flatten(runs, self.block_size)
            last_rows = batch.query_start[1:] - 1
            logits = self.model.logits_in_output_vocab(self.runner.forward(batch, last_rows))
            self.num_forwards += 1
            num_rows = sum(len(run.token_ids) for run in runs)
            for i, run in zip(active, runs, strict=True):
                self._computed[requests[i].seq.seq_id] = run.start_position + len(run.token_ids)
            rows = [requests[i].seq.sampling_row(tokens[i]) for i in active]
            drafted, q, chosen = self._sample(logits, rows, keep_probs)
            for row, i in enumerate(active):
                tokens[i].append(drafted[row])
                confidence[i] *= chosen[row]
                if q is not None:
                    probs[i].append(q[row])
            self._forward_times.append((num_rows, time.perf_counter() - started))
            del self._forward_times[:-MAX_FORWARD_TIMES]  # nobody may be taking them
            active = [
                i
                for i in active
                if requests[i].max_drafts > step + 1 and confidence[i] >= self.confidence_threshold
            ]
            runs = [
                TokenRun(
                    [tokens[i][-1]], requests[i].seq.num_tokens + step, requests[i].seq.block_table
                )
                for i in active
            ]
            if not active:
                break
        draft_probs = None
        if keep_probs:
            draft_probs = torch.stack([row for per_request in probs for row in per_request])
        return Proposal(tokens, draft_probs)

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], need_q: bool
    ) -> tuple[list[int], torch.Tensor | None, list[float]]:
        """Draft tokens (drawn exactly as the target's sampler would draw from q), their
        distributions q (when ``need_q``: one-hot on greedy rows), and, with a confidence
        threshold, the draft's probability of each drafted token (for greedy rows: under its
        unscaled softmax; 1 without a threshold)."""
        t = SamplingTensors.build(rows, logits.shape[1], logits.device)
        q = target_probs(logits, t) if need_q or not t.all_greedy else None
        drafted = greedy_tokens(logits, t) if q is None else sample_rows(q, rows, t, self.generator)
        if not self.confidence_threshold:
            return drafted.tolist(), q, [1.0] * len(rows)
        chosen = None if q is None else q.gather(1, drafted[:, None])[:, 0]
        if t.any_greedy:  # q is one-hot there: take the softmax's confidence instead
            natural = torch.softmax(apply_penalties(logits.float(), t), dim=-1).amax(-1)
            chosen = natural if chosen is None else torch.where(t.greedy, natural, chosen)
        assert chosen is not None
        return drafted.tolist(), q, chosen.tolist()

    def catch_up(self, seq: Sequence) -> int:
        """Rows the draft computes for ``seq`` before its first draft: 1 or 2 after a
        verify, more after steps it was skipped, the whole prompt for a new sequence."""
        return seq.num_tokens - self._computed.get(seq.seq_id, 0)

    def take_forward_times(self) -> list[tuple[int, float]]:
        """(rows, seconds) of every draft forward since the last call (sampling included)."""
        times, self._forward_times = self._forward_times, []
        return times

    def on_verified(self, seq: Sequence) -> None:
        held = self._computed.get(seq.seq_id)
        if held is not None:
            self._computed[seq.seq_id] = min(held, seq.num_computed_tokens)

    def forget(self, seq: Sequence) -> None:
        self._computed.pop(seq.seq_id, None)
