"""The speculation benchmarks' runner: engines generating the same prompts in lockstep.

``run`` generates for every prompt with one engine; ``run_lockstep`` does it for several
engines at once, always stepping the engine that has emitted the fewest tokens so far, so that
all of them cover the same tokens over the same stretch of wall time and a drift of the shared
machine's speed lands on every engine alike. Each step is recorded (``StepRecord``: its time,
tokens, and what speculation planned and verified in it), read from the engine's stats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from specbatch import LLMEngine, SamplingParams
from specbatch.engine.stats import EngineStats


class Timer:
    """Accumulates the time and calls of a wrapped method (instrumentation only: the method
    runs unchanged)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds, self.calls = 0.0, 0
        original = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(owner, name, wrapped)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    @property
    def mean(self) -> float:
        return self.seconds / self.calls if self.calls else 0.0


@dataclass(frozen=True)
class StepRecord:
    """One engine step: its wall time and emitted tokens; the way its drafts went (the
    controller's ways joined by ``+``, ``fixed`` for a proposer without the controller, None:
    no drafts) and how many (planned by the controller, else verified), those accepted; and,
    where the controller planned it, its predicted step time without drafts and the price of
    one more verify row, in seconds."""

    seconds: float
    tokens: int
    way: str | None
    drafts: int
    accepted: int
    planned: bool
    plain_seconds: float
    row_seconds: float


def _counts(stats: EngineStats) -> tuple[int, int, int]:
    return stats.num_planned_steps, stats.num_draft_tokens, stats.num_accepted_tokens


class Job:
    """One engine generating for every prompt with at most ``concurrency`` requests in flight,
    one step at a time (``step``), timed per step so that jobs of several engines can run in
    lockstep (``run_lockstep``)."""

    def __init__(
        self,
        engine: LLMEngine,
        prompts: list[list[int]],
        max_tokens: int,
        concurrency: int,
        params: list[SamplingParams] | None = None,
    ) -> None:
        """``params``: each prompt's (greedy, ``max_tokens`` by default)."""
        self.engine, self.concurrency = engine, concurrency
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.params = params or [greedy] * len(prompts)
        stats = engine.stats
        self.before = (
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            stats.num_planned_steps,
            stats.num_drafting_steps,
            stats.num_drafts_allotted,
        )
        self.depth_before = (
            list(stats.num_drafts_per_pos),
            list(stats.num_accepted_tokens_per_pos),
        )
        self.pending = list(enumerate(prompts))
        self.index: dict[str, int] = {}
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.emitted: dict[str, int] = {}  # tokens each request has so far
        self.progress = 0  # tokens emitted, all requests
        self.elapsed = 0.0
        self.steps: list[StepRecord] = []

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished_requests()

    def step(self) -> None:
        """Admit what fits, then one engine step; both timed."""
        engine = self.engine
        counts = _counts(engine.stats)
        start = time.perf_counter()
        while self.pending and engine.num_unfinished_requests() < self.concurrency:
            i, prompt = self.pending.pop(0)
            request_id = f"spec-{time.monotonic_ns()}-{i}"
            self.index[request_id] = i
            engine.add_request(request_id, prompt, self.params[i])
        outputs = engine.step()
        seconds = time.perf_counter() - start
        self.elapsed += seconds
        progress = self.progress
        for out in outputs:
            count = len(out.outputs[0].token_ids)
            self.progress += count - self.emitted.get(out.request_id, 0)
            self.emitted[out.request_id] = count
            if out.finished:
                self.outputs[self.index[out.request_id]] = list(out.outputs[0].token_ids)
        self.steps.append(_record(engine.stats, counts, seconds, self.progress - progress))

    def result(self) -> dict[str, Any]:
        stats, before = self.engine.stats, self.before
        tokens = sum(len(ids) for ids in self.outputs)
        drafts = stats.num_drafts - before[0]
        drafted = stats.num_draft_tokens - before[1]
        accepted = stats.num_accepted_tokens - before[2]
        planned = stats.num_planned_steps - before[3]
        return {
            "drafting_share": (stats.num_drafting_steps - before[4]) / planned if planned else 0.0,
            "drafts_per_step": (stats.num_drafts_allotted - before[5]) / planned
            if planned
            else 0.0,
            "row_cost": stats.last_plan.row_seconds / stats.last_plan.step_seconds
            if stats.last_plan.step_seconds
            else 0.0,
            "outputs": self.outputs,
            "tokens": tokens,
            "seconds": self.elapsed,
            "tok_s": tokens / self.elapsed,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_by_depth": _by_depth(stats, *self.depth_before),
            "steps": self.steps,
        }


def _record(
    stats: EngineStats, before: tuple[int, int, int], seconds: float, tokens: int
) -> StepRecord:
    """The step that moved ``stats`` on from the counts ``before``."""
    planned_before, drafted_before, accepted_before = before
    drafted = stats.num_draft_tokens - drafted_before
    accepted = stats.num_accepted_tokens - accepted_before
    if stats.num_planned_steps == planned_before:  # no plan of the controller's
        way = "fixed" if drafted else None
        return StepRecord(seconds, tokens, way, drafted, accepted, False, 0.0, 0.0)
    plan = stats.last_plan
    way = "+".join(sorted(w for w, n in plan.by_way.items() if n)) or None
    return StepRecord(
        seconds, tokens, way, plan.drafts, accepted, True, plan.step_seconds, plan.row_seconds
    )


def run(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    params: list[SamplingParams] | None = None,
) -> dict[str, Any]:
    """Generate for every prompt with at most ``concurrency`` requests in flight."""
    job = Job(engine, prompts, max_tokens, concurrency, params)
    while not job.done:
        job.step()
    return job.result()


def run_lockstep(
    engines: dict[str, LLMEngine],
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    params: dict[str, list[SamplingParams]] | None = None,
) -> dict[str, dict[str, Any]]:
    """``run`` for every engine at once, in lockstep by progress: the next step is always
    the one of the engine that has emitted the fewest tokens so far, each engine's time the
    sum of its own steps. Outputs are the same across engines (greedy), so a faster engine
    steps less often and all of them cover the same tokens over the same stretch of wall
    time, ending together: a drift in the machine's speed (10-15% between runs minutes apart
    on this shared host) lands on every engine alike, where whole runs one after another
    each met their own stretch of it. ``params``: an engine's per-prompt parameters."""
    jobs = {
        name: Job(engine, prompts, max_tokens, concurrency, (params or {}).get(name))
        for name, engine in engines.items()
    }
    turn = 0
    while waiting := [job for job in jobs.values() if not job.done]:
        least = min(job.progress for job in waiting)
        tied = [job for job in waiting if job.progress == least]
        tied[turn % len(tied)].step()  # ties (the start) taken in turn
        turn += 1
    return {name: job.result() for name, job in jobs.items()}


def _by_depth(stats: Any, drafts_before: list[int], accepted_before: list[int]) -> list[float]:
    """Acceptance at each draft depth since the counts ``*_before``."""
    out = []
    for d, drafts in enumerate(stats.num_drafts_per_pos):
        n = drafts - (drafts_before[d] if d < len(drafts_before) else 0)
        a = stats.num_accepted_tokens_per_pos[d] - (
            accepted_before[d] if d < len(accepted_before) else 0
        )
        if n > 0:
            out.append(a / n)
    return out
