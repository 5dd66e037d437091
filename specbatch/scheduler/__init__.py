"""Scheduling policy: queues, token budget, chunked prefill, preemption, lookahead reservation."""

from specbatch.scheduler.scheduler import (
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = ["ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
