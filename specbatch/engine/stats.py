"""The engine's counters and gauges, read by metrics exporters and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.spec_decode.control.choices import PlanReport
from specbatch.spec_decode.plan import SpecCounters


@dataclass
class EngineStats:
    """Engine-wide counters (monotonic) and the latest gauges, for metrics exporters."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_finished: int = 0
    num_requests_failed: int = 0
    num_failed_steps: int = 0
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_tree_drafts: int = 0  # sequence-steps whose drafts were a tree (of num_drafts)
    num_tree_moves: int = 0  # accepted tree nodes whose K/V moved to their position
    # drafts that were a constraint's forced tokens (structured outputs), and those accepted:
    # the forced share of the output is num_forced_accepted_tokens / num_generation_tokens
    num_forced_draft_tokens: int = 0
    num_forced_accepted_tokens: int = 0
    # per draft depth d (0: the first draft): verifies with a draft at that depth, and those
    # that accepted it (acceptance by depth is their ratio; a tree's depth is its levels)
    num_drafts_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # per way of drafting (lookup1..3, suffix, draft, forced, external): draft tokens
    # verified and those accepted
    num_draft_tokens_by_way: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens_by_way: dict[str, int] = field(default_factory=dict)
    # the store of other requests' tokens (speculation across requests; 0 without one):
    # tokens and requests held, lookups and those that found a match
    suffix_store_tokens: int = 0
    suffix_store_requests: int = 0
    suffix_lookups: int = 0
    suffix_hits: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # The goodput controller (speculation on, adaptive_k): counters, then its last step's
    # report (candidates, sequences drafting, drafts, estimated step and row seconds, gain).
    num_planned_steps: int = 0  # steps it planned (with decodes that had draft slots)
    num_drafting_steps: int = 0  # ... of which it gave some sequence drafts
    num_drafts_allotted: int = 0  # draft slots it gave (proposers may draft fewer)
    last_plan: PlanReport = field(default_factory=PlanReport)

    def add_speculation(self, step: SpecCounters) -> None:
        """A step's speculation counters (and its plan's report, when it was planned)."""
        self.num_drafts += step.num_drafts
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_tokens += step.num_accepted_tokens
        self.num_tree_drafts += step.num_tree_drafts
        self.num_tree_moves += step.num_tree_moves
        self.num_forced_draft_tokens += step.num_forced_draft_tokens
        self.num_forced_accepted_tokens += step.num_forced_accepted_tokens
        for depth, accepted in step.depths:
            self._count_depth(depth, accepted)
        for way, (drafts, accepted) in step.by_way.items():
            by_way = self.num_draft_tokens_by_way
            by_way[way] = by_way.get(way, 0) + drafts
            by_way = self.num_accepted_tokens_by_way
            by_way[way] = by_way.get(way, 0) + accepted
        report = step.report
        if report is None or not report.candidates:
            return
        self.num_planned_steps += 1
        self.num_drafting_steps += report.drafts > 0
        self.num_drafts_allotted += report.drafts
        self.last_plan = report

    def _count_depth(self, depth: int, accepted: int) -> None:
        """A verify whose drafts reached ``depth`` levels and accepted ``accepted`` of them."""
        for counts, upto in (
            (self.num_drafts_per_pos, depth),
            (self.num_accepted_tokens_per_pos, accepted),
        ):
            if len(counts) < depth:
                counts.extend([0] * (depth - len(counts)))
            for d in range(upto):
                counts[d] += 1

    @classmethod
    def combined(cls, parts: list[EngineStats]) -> EngineStats:
        """Several engines' stats as one (data-parallel replicas): counts and queue lengths
        add up (each replica's store too), per-depth and per-way counts add up, the cache's
        usage is the mean; the last plan is the busiest replica's (most candidates)."""
        total = cls()
        for part in parts:
            for name, value in vars(part).items():
                if isinstance(value, int):
                    setattr(total, name, getattr(total, name) + value)
            for mine, theirs in (
                (total.num_drafts_per_pos, part.num_drafts_per_pos),
                (total.num_accepted_tokens_per_pos, part.num_accepted_tokens_per_pos),
            ):
                mine.extend([0] * (len(theirs) - len(mine)))
                for depth, count in enumerate(theirs):
                    mine[depth] += count
            for total_by_way, part_by_way in (
                (total.num_draft_tokens_by_way, part.num_draft_tokens_by_way),
                (total.num_accepted_tokens_by_way, part.num_accepted_tokens_by_way),
            ):
                for way, count in part_by_way.items():
                    total_by_way[way] = total_by_way.get(way, 0) + count
        if parts:
            total.kv_cache_usage = sum(p.kv_cache_usage for p in parts) / len(parts)
            total.last_plan = max(parts, key=lambda p: p.last_plan.candidates).last_plan
        return total
