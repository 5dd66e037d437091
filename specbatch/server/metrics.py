"""Prometheus metrics: engine counters and gauges read at scrape time, latency histograms.

Names follow vLLM's where vLLM has the concept (``vllm:`` becomes ``specbatch_``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specbatch.engine.async_engine import ServedEngine
from specbatch.engine.stats import EngineStats
from specbatch.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """Reads the engine's monotonic counters and current gauges on every scrape: one row per
    data-parallel replica (label ``replica``, and ``replica="all"`` their sum) or, for one
    engine, one row without that label."""

    def __init__(self, engine: ServedEngine, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        rows = self.engine.stats_by_replica()
        labels = ["model_name"] if rows[0][0] is None else ["model_name", "replica"]
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for replica, stats, waiting in rows:
            values = [self.model] if replica is None else [self.model, replica]
            for family in self._rows(stats, waiting, labels, values):
                kept = families.setdefault(family.name, family)
                if kept is not family:
                    kept.samples.extend(family.samples)
        yield from families.values()

    def _rows(
        self, stats: EngineStats, waiting: int, labels: list[str], values: list[str]
    ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for name, doc, value in [
            ("specbatch_prompt_tokens", "Prefill tokens computed.", stats.num_prompt_tokens),
            ("specbatch_generation_tokens", "Tokens generated.", stats.num_generation_tokens),
            ("specbatch_num_preemptions", "Sequences preempted.", stats.num_preemptions),
            ("specbatch_spec_decode_num_drafts", "Verify steps with drafts.", stats.num_drafts),
            (
                "specbatch_spec_decode_num_draft_tokens",
                "Draft tokens proposed.",
                stats.num_draft_tokens,
            ),
            (
                "specbatch_spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
                stats.num_accepted_tokens,
            ),
            (
                "specbatch_spec_decode_num_forced_draft_tokens",
                "Draft tokens that were a constraint's forced tokens (structured outputs).",
                stats.num_forced_draft_tokens,
            ),
            (
                "specbatch_spec_decode_num_forced_accepted_tokens",
                "Forced draft tokens accepted.",
                stats.num_forced_accepted_tokens,
            ),
            (
                "specbatch_spec_decode_num_tree_drafts",
                "Verify steps of a sequence whose drafts were a tree.",
                stats.num_tree_drafts,
            ),
            (
                "specbatch_spec_decode_num_tree_moves",
                "Accepted tree nodes whose K/V moved to their position.",
                stats.num_tree_moves,
            ),
            (
                "specbatch_spec_suffix_lookups",
                "Lookups in the store of other requests' tokens (speculation across requests).",
                stats.suffix_lookups,
            ),
            (
                "specbatch_spec_suffix_hits",
                "Lookups in the store that found a match.",
                stats.suffix_hits,
            ),
            (
                "specbatch_spec_controller_planned_steps",
                "Steps whose drafts the goodput controller chose.",
                stats.num_planned_steps,
            ),
            (
                "specbatch_spec_controller_drafting_steps",
                "Planned steps in which some sequence got drafts.",
                stats.num_drafting_steps,
            ),
            (
                "specbatch_spec_controller_drafts_allotted",
                "Draft slots the goodput controller gave.",
                stats.num_drafts_allotted,
            ),
        ]:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        for name, doc, counts in (
            (
                "specbatch_spec_decode_num_drafts_per_pos",
                "Verify steps with a draft at this depth (0: the first draft).",
                stats.num_drafts_per_pos,
            ),
            (
                "specbatch_spec_decode_num_accepted_tokens_per_pos",
                "Drafts accepted at this depth (0: the first draft).",
                stats.num_accepted_tokens_per_pos,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=[*labels, "position"])
            for position, count in enumerate(counts):
                family.add_metric([*values, str(position)], count)
            yield family
        for name, doc, by_way in (
            (
                "specbatch_spec_decode_num_draft_tokens_by_way",
                "Draft tokens verified, by way of drafting (lookup1..3, suffix, draft, forced).",
                stats.num_draft_tokens_by_way,
            ),
            (
                "specbatch_spec_decode_num_accepted_tokens_by_way",
                "Draft tokens accepted, by way of drafting.",
                stats.num_accepted_tokens_by_way,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=[*labels, "way"])
            for way, count in sorted(by_way.items()):
                family.add_metric([*values, way], count)
            yield family
        rate = stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
        gauges: list[tuple[str, str, float]] = [
            ("specbatch_num_requests_running", "Sequences running.", stats.num_running),
            ("specbatch_num_requests_waiting", "Requests waiting.", waiting),
            (
                "specbatch_kv_cache_usage_perc",
                "Fraction of KV blocks in use.",
                stats.kv_cache_usage,
            ),
            ("specbatch_spec_decode_acceptance_rate", "Accepted / proposed draft tokens.", rate),
            (
                "specbatch_spec_suffix_store_tokens",
                "Tokens held in the store of other requests' tokens.",
                stats.suffix_store_tokens,
            ),
            (
                "specbatch_spec_suffix_store_requests",
                "Requests held in that store.",
                stats.suffix_store_requests,
            ),
            (
                "specbatch_spec_decode_mean_accepted_length",
                "Tokens emitted per verify step with drafts (accepted drafts + 1).",
                1.0 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else 0.0,
            ),
            (
                "specbatch_spec_controller_seqs_drafting",
                "Sequences given drafts in the last planned step.",
                stats.last_plan.seqs_drafting,
            ),
            (
                "specbatch_spec_controller_candidates",
                "Decoding sequences the last planned step considered.",
                stats.last_plan.candidates,
            ),
            (
                "specbatch_spec_controller_drafts",
                "Drafts given in the last planned step.",
                stats.last_plan.drafts,
            ),
            (
                "specbatch_spec_controller_step_seconds",
                "The step-time model's estimate of the last planned step before drafts.",
                stats.last_plan.step_seconds,
            ),
            (
                "specbatch_spec_controller_row_seconds",
                "The step-time model's cost of one more verify row in that step.",
                stats.last_plan.row_seconds,
            ),
            (
                "specbatch_spec_controller_expected_gain",
                "Planned tokens per second over the plain step's, last planned step.",
                stats.last_plan.expected_gain,
            ),
        ]
        for gauge_name, gauge_doc, level in gauges:
            gauge = GaugeMetricFamily(gauge_name, gauge_doc, labels=labels)
            gauge.add_metric(values, level)
            yield gauge


class ServerMetrics:
    """Every metric of one server, in its own registry (several servers may share a process)."""

    def __init__(self, engine: ServedEngine, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model))
        self.requests = Counter(
            "specbatch_request_success",
            "Finished requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "specbatch_request_rejected",
            "Requests refused (4xx).",
            ["model_name", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "specbatch_time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "specbatch_time_per_output_token_seconds",
            "Mean time per output token after the first.",
            ["model_name"],
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "specbatch_e2e_request_latency_seconds",
            "Request latency.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        engine.on_finished.append(self.observe_finished)

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        reason = output.outputs[0].finish_reason or "abort"
        self.requests.labels(self.model, reason).inc()
        if m.first_token_time is not None:
            self.ttft.labels(self.model).observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None and m.num_generation_tokens > 1:
                per_token = (m.finished_time - m.first_token_time) / (m.num_generation_tokens - 1)
                self.tpot.labels(self.model).observe(per_token)
        if m.finished_time is not None:
            self.e2e.labels(self.model).observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
