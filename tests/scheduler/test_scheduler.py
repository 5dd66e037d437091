"""Scheduler policy with tiny configurations: exact budgets, block ids and preemption order."""

from __future__ import annotations

import itertools

from specbatch.cache.kv_cache_manager import KVCacheManager
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from specbatch.sequence import Sequence, SequenceStatus

_ids = itertools.count()


def make_seq(length: int, arrival: float, priority: int = 0, max_tokens: int = 100) -> Sequence:
    return Sequence(
        next(_ids),
        f"r{arrival}",
        0,
        list(range(1, length + 1)),
        SamplingParams(max_tokens=max_tokens),
        arrival,
        priority,
    )


def make(
    num_blocks: int = 16,
    block_size: int = 4,
    budget: int = 16,
    max_seqs: int = 8,
    k: int = 0,
    prefix: bool = False,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_seqs, budget, max_model_len=64, num_speculative_tokens=k),
        KVCacheManager(num_blocks, block_size, prefix),
    )


def run_step(scheduler: Scheduler) -> list[tuple[int, int, int]]:
    """Schedule, then pretend the model ran: computed tokens advance, decodes get a token."""
    out = scheduler.schedule()
    plan = [(s.seq.seq_id, s.num_new_tokens, s.num_lookahead) for s in out.scheduled]
    for s in out.scheduled:
        done = s.completes_sequence
        s.seq.num_computed_tokens += s.num_new_tokens
        if done:
            s.seq.token_ids.append(7)
    return plan


def test_chunked_prefill_and_decode_share_the_budget() -> None:
    sched = make(budget=10)
    a, b = make_seq(6, 0.0), make_seq(12, 1.0)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [(a.seq_id, 6, 0), (b.seq_id, 4, 0)]
    assert run_step(sched) == [(a.seq_id, 1, 0), (b.seq_id, 8, 0)]
    assert run_step(sched) == [(a.seq_id, 1, 0), (b.seq_id, 1, 0)]
    assert a.block_table == [0, 1]
    assert b.block_table == [2, 3, 4, 5]


def test_max_num_seqs_limits_admission() -> None:
    sched = make(max_seqs=2)
    seqs = [make_seq(2, float(i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert [p[0] for p in run_step(sched)] == [seqs[0].seq_id, seqs[1].seq_id]
    assert sched.waiting == [seqs[2]]


def test_priority_orders_the_waiting_queue() -> None:
    sched = make(budget=4)
    low, high = make_seq(4, 0.0, priority=5), make_seq(4, 1.0, priority=0)
    sched.add(low)
    sched.add(high)
    assert run_step(sched) == [(high.seq_id, 4, 0)]


def test_lookahead_reserves_draft_slots_within_limits() -> None:
    sched = make(k=3, block_size=4)
    seq = make_seq(5, 0.0, max_tokens=3)
    sched.add(seq)
    assert run_step(sched) == [(seq.seq_id, 5, 0)]  # prefill: no drafts
    # 1 output so far, max_tokens 3: at most 1 more draft (plus the bonus token)
    assert run_step(sched) == [(seq.seq_id, 1, 1)]
    assert len(seq.block_table) == 2  # positions 0..6 -> 2 blocks


def test_preempts_the_newest_when_blocks_run_out() -> None:
    sched = make(num_blocks=4, block_size=2, budget=32)
    old, new = make_seq(3, 0.0), make_seq(3, 1.0)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # each holds 2 blocks (positions 0-3), the pool is empty
    assert sched.cache.num_free_blocks == 0
    run_step(sched)  # both decode position 3, which still fits
    plan = run_step(sched)
    # old decodes position 4 and needs a 3rd block: new, the newest, is preempted for it
    assert plan == [(old.seq_id, 1, 0)]
    assert new.status is SequenceStatus.WAITING
    assert new.num_computed_tokens == 0
    assert new.num_preemptions == 1
    assert new.block_table == []
    assert sched.waiting == [new]


def test_self_preemption_when_alone_does_not_loop() -> None:
    sched = make(num_blocks=2, block_size=2, budget=32)
    a = make_seq(4, 0.0)
    sched.add(a)
    assert run_step(sched) == [(a.seq_id, 4, 0)]  # both blocks
    out = sched.schedule()  # its next token needs a third block: only itself to preempt
    assert out.scheduled == []
    assert out.preempted == [a]
    assert sched.running == []
    assert sched.waiting == [a]
    assert a.block_table == []
    assert a.num_computed_tokens == 0
    assert sched.cache.num_free_blocks == 2
    assert sched.schedule().is_empty  # it cannot fit again, and scheduling still returns


def test_preemption_takes_the_newest_other_sequence_first() -> None:
    sched = make(num_blocks=2, block_size=2, budget=32)
    a, b = make_seq(2, 0.0), make_seq(2, 1.0)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    plan = run_step(sched)  # both need a 2nd block; only b can be preempted for a
    assert plan == [(a.seq_id, 1, 0)]
    assert sched.running == [a]


def test_drafts_are_dropped_before_anyone_is_preempted() -> None:
    sched = make(num_blocks=2, block_size=4, k=4, budget=32)
    a, b = make_seq(3, 0.0), make_seq(2, 1.0)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    # Each holds one block and the pool is empty. With 4 drafts a decode would need a second
    # block; without them the next position still fits in the first.
    assert run_step(sched) == [(a.seq_id, 1, 0), (b.seq_id, 1, 0)]
    assert a.num_preemptions == b.num_preemptions == 0


def test_a_draft_planner_takes_budget_only_after_prompts_are_admitted() -> None:
    """With the goodput controller, drafts never delay a prompt: a decode's slots are reserved
    in the cache, prompts are admitted with the budget, and the planner's drafts get what is
    left (here it asks for every slot)."""
    asked: list[tuple[list[int], int]] = []

    class EverySlot:
        def __init__(self, out: SchedulerOutput) -> None:
            self.slots = {s.seq.seq_id: s.num_lookahead for s in out.scheduled}

        def rows(self, seq_id: int) -> int:
            return self.slots[seq_id]

    def every_slot(out: SchedulerOutput, budget: int) -> EverySlot:
        asked.append(([s.num_lookahead for s in out.scheduled], budget))
        return EverySlot(out)

    sched = Scheduler(
        SchedulerConfig(
            8, 10, max_model_len=64, num_speculative_tokens=4, drafts_after_prompts=True
        ),
        KVCacheManager(32, 4, False),
        draft_planner=every_slot,
    )
    a = make_seq(3, 0.0)
    sched.add(a)
    assert run_step(sched) == [(a.seq_id, 3, 0)]  # a prefill: no slots
    b = make_seq(20, 1.0)
    sched.add(b)
    # a decodes (1 token, 4 slots reserved); b's prompt takes the 9 tokens left; no draft fits
    assert run_step(sched) == [(a.seq_id, 1, 0), (b.seq_id, 9, 0)]
    assert asked[-1] == ([4, 0], 0)
    # b's last 11 prompt tokens do not fit either: 1 + 9 again, still no drafts
    assert run_step(sched) == [(a.seq_id, 1, 0), (b.seq_id, 9, 0)]
    # b has 2 prompt tokens left: a gets 4 drafts, b's rest and then a 3 more tokens' worth
    assert run_step(sched) == [(a.seq_id, 1, 4), (b.seq_id, 2, 0)]
    assert asked[-1] == ([4, 0], 7)
    # both decode: 2 tokens, 8 drafts asked, the budget leaves 8
    assert run_step(sched) == [(a.seq_id, 1, 4), (b.seq_id, 1, 4)]
