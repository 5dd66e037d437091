"""Which sequences run this step, with how many tokens, and who is preempted.

Policy (vLLM V1 style, one token budget per step):

1. Running sequences first, in admission order. A decode needs one token plus its lookahead
   (draft slots); a sequence still prefilling takes as much of its prompt as the budget allows
   (chunked prefill). When the cache cannot hold a sequence's step, speculation is dropped for it
   first; then the lowest-priority, newest running sequence is preempted (its blocks freed, its
   tokens kept, recomputed later), possibly the sequence itself.
2. Then waiting sequences by (priority, arrival), while the budget, ``max_num_seqs`` and the
   cache allow, reusing prefix-cached blocks. Nothing is admitted in a step that preempted.
3. With speculation on, a draft planner (the speculator) then says how many of its reserved
   slots each decode uses this step; its plan travels with the step (``draft_plan``). Under
   the goodput controller (``drafts_after_prompts``) draft slots are reserved in the cache in
   step 1 but take no budget there: prompts are admitted first, and the planner chooses each
   decode's drafts within what the budget has left, so speculation never delays a prompt.
   With a fixed k the slots take budget with their decode.

After the step, :meth:`Scheduler.update_from_output` is the one place where what happened
reaches the cache: computed tokens advance (accepted drafts included), full blocks of final
tokens enter the prefix index, rejected draft slots are rolled back and finished sequences
leave their queue and free their blocks. The scheduler touches no tensors: it returns a plain
:class:`SchedulerOutput` and takes back plain counts.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from specbatch.cache.kv_cache_manager import KVCacheManager
from specbatch.cache.window_cache import HybridKVCache
from specbatch.sequence import Sequence, SequenceStatus


class DraftRows(Protocol):
    """A step's draft plan as the scheduler sees it."""

    def rows(self, seq_id: int) -> int:
        """Draft slots the sequence uses this step (at most those reserved)."""
        ...


# Given a step before drafts and the budget left, its draft plan.
DraftPlanner = Callable[["SchedulerOutput", int], DraftRows]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_speculative_tokens: int = 0
    # draft slots take token budget only once prompts are admitted (the goodput controller)
    drafts_after_prompts: bool = False


@dataclass
class ScheduledSequence:
    """``num_new_tokens`` of ``seq.token_ids`` (from ``num_computed_tokens`` on) are computed this
    step, and ``num_lookahead`` slots after them are reserved for draft tokens."""

    seq: Sequence
    num_new_tokens: int
    num_lookahead: int = 0

    @property
    def completes_sequence(self) -> bool:
        """True when this step reaches the last token, so its logits yield a new token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    draft_plan: DraftRows | None = None  # the planner's, when there is one

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _order(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    """Waiting and running queues over a :class:`KVCacheManager`."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: KVCacheManager | HybridKVCache,
        draft_planner: DraftPlanner | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.draft_planner = draft_planner
        self.waiting: list[Sequence] = []  # sorted by _order
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self._budget = 0  # tokens left in the step being scheduled

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the cache's blocks held by sequences."""
        return self.cache.usage

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_order)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of its queue and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.config.max_num_batched_tokens
        planned = self.config.drafts_after_prompts
        for seq in list(self.running):
            if self._budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, self._budget)
            lookahead = 0
            if num_new == 1:
                lookahead = self.lookahead(seq)
                if not planned:
                    lookahead = min(lookahead, self._budget - num_new)
            granted = self._allocate_or_preempt(seq, num_new, lookahead, out)
            if granted is not None:
                out.scheduled.append(ScheduledSequence(seq, num_new, granted))
                self._budget -= num_new + (0 if planned else granted)
        if not out.preempted:
            self._admit(out)
        if self.draft_planner is not None:
            self._plan_drafts(out)
        return out

    def _plan_drafts(self, out: SchedulerOutput) -> None:
        """The planner's drafts per scheduled sequence, at most its reserved slots (and, when
        drafts come after prompts, at most the budget left in all)."""
        assert self.draft_planner is not None
        plan = self.draft_planner(out, max(self._budget, 0))
        for scheduled in out.scheduled:
            count = min(plan.rows(scheduled.seq.seq_id), scheduled.num_lookahead)
            if self.config.drafts_after_prompts:
                count = max(0, min(count, self._budget))
                self._budget -= count
            scheduled.num_lookahead = count
        out.draft_plan = plan

    def update_from_output(
        self, out: SchedulerOutput, num_accepted: dict[int, int]
    ) -> list[Sequence]:
        """Apply a step that ran ``out``: every scheduled sequence computed its new tokens plus
        ``num_accepted[seq_id]`` accepted drafts, and has already appended the tokens it
        emitted (and finished, if a stop rule said so). Returns the sequences that finished;
        they are out of their queues with their blocks freed."""
        finished = []
        for scheduled in out.scheduled:
            seq = scheduled.seq
            seq.num_computed_tokens += scheduled.num_new_tokens + num_accepted.get(seq.seq_id, 0)
            self.cache.commit(seq)  # before any free: a finished prefix stays reusable
            if seq.is_finished:
                self.remove(seq)
                finished.append(seq)
            else:
                # Rollback: keep the blocks the next step needs (its token plus lookahead).
                self.cache.truncate(seq, seq.num_tokens + self.lookahead(seq))
        return finished

    def lookahead(self, seq: Sequence) -> int:
        """Draft slots a decoding sequence may use: never past max_tokens or the context."""
        k = self.config.num_speculative_tokens
        if k == 0:
            return 0
        room_in_context = self.config.max_model_len - seq.num_tokens
        max_tokens = seq.params.max_tokens
        room_in_output = k if max_tokens is None else max_tokens - seq.num_output_tokens - 1
        return max(0, min(k, room_in_context, room_in_output))

    def _allocate_or_preempt(
        self, seq: Sequence, num_new: int, lookahead: int, out: SchedulerOutput
    ) -> int | None:
        """Reserve slots for ``seq``; the lookahead it got, or None if ``seq`` was preempted."""
        while True:
            if self.cache.allocate(seq, num_new, lookahead):
                return lookahead
            if lookahead and self.cache.allocate(seq, num_new, 0):
                return 0
            victim = max(self.running, key=_order)
            self._preempt(victim, out)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        for i, scheduled in enumerate(out.scheduled):
            if scheduled.seq is seq:  # already granted this step: take it back
                del out.scheduled[i]
                charged = 0 if self.config.drafts_after_prompts else scheduled.num_lookahead
                self._budget += scheduled.num_new_tokens + charged
                break
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def _admit(self, out: SchedulerOutput) -> None:
        while self.waiting and self._budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # A request asking for prompt logprobs must compute every prompt position.
            wants_prompt_rows = seq.params.prompt_logprobs is not None
            prefix = [] if wants_prompt_rows else self.cache.find_cached_prefix(seq)
            cached_tokens = len(prefix) * self.cache.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - cached_tokens, self._budget)
            if not self.cache.allocate(seq, num_new, 0, prefix):
                break
            self.waiting.pop(0)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_prompt_tokens = min(cached_tokens, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            self._budget -= num_new
