"""``LLMEngine``: add requests, step, read outputs. One step batches every running sequence.

A step: the scheduler picks sequences and reserves their slots; the speculator drafts for the
ones that will sample; the runner computes every sequence's new tokens and drafts in one
forward; the speculator verifies; each request takes its new tokens through its stop rules;
the scheduler applies the step to its queues and the cache (``update_from_output``). The engine
itself never touches the cache. A step that raises fails only the requests in it: they end
with finish reason ``"error"`` and their blocks freed, and the engine goes on.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from specbatch.cache.kv_cache_manager import KVCacheManager
from specbatch.config import EngineConfig
from specbatch.engine.intake import RequestIntake, check_priority
from specbatch.engine.logprobs import ranked_logprobs
from specbatch.engine.request_state import RequestState
from specbatch.engine.setup import allocate_cache, capture_draft_graphs, capture_graphs, load_models
from specbatch.errors import InvalidRequestError, TensorParallelError
from specbatch.outputs import RequestOutput
from specbatch.runner.flat_batch import LogitRows, TokenRun
from specbatch.runner.model_runner import ModelRunner
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput
from specbatch.sequence import Sequence
from specbatch.spec_decode.factory import build_speculator
from specbatch.spec_decode.proposer import Proposal, Proposer
from specbatch.spec_decode.rejection import VerifyResult
from specbatch.spec_decode.tree_verify import node_depths

if TYPE_CHECKING:
    from specbatch.parallel.workers import TensorParallelGroup, TensorParallelRunner

logger = logging.getLogger("specbatch")


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
    # per draft depth d (0: the first draft): verifies with a draft at that depth, and those
    # that accepted it (acceptance by depth is their ratio; a tree's depth is its levels)
    num_drafts_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # The goodput controller (speculation on, adaptive_k): counters, then its last step.
    num_planned_steps: int = 0  # steps it planned (with decodes that had draft slots)
    num_drafting_steps: int = 0  # ... of which it gave some sequence drafts
    num_drafts_allotted: int = 0  # draft slots it gave (proposers may draft fewer)
    spec_candidates: int = 0  # decoding sequences it considered in the last planned step
    spec_seqs_drafting: int = 0  # ... and gave drafts
    spec_drafts_allotted: int = 0  # ... and the drafts it gave them
    spec_step_seconds: float = 0.0  # its step-time model: that step before drafts
    spec_row_seconds: float = 0.0  # ... and what one more verify row adds to it
    spec_expected_gain: float = 1.0  # planned tokens per second over the plain step's

    def count_depths(self, depth: int, accepted: int) -> None:
        """A verify whose drafts reached ``depth`` levels and accepted ``accepted`` of them."""
        for counts, upto in (
            (self.num_drafts_per_pos, depth),
            (self.num_accepted_tokens_per_pos, accepted),
        ):
            if len(counts) < depth:
                counts.extend([0] * (depth - len(counts)))
            for d in range(upto):
                counts[d] += 1


class LLMEngine:
    """Continuous batching over a paged KV cache.

    ``add_request`` queues a request, ``step`` runs one batched forward over every scheduled
    sequence and returns the outputs that changed, ``abort`` stops a request and frees its blocks
    at once. Not thread-safe: drive it from one thread (``AsyncEngine`` does that for asyncio).
    """

    def __init__(self, config: EngineConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.dead: str | None = None  # why the engine cannot go on (a tensor-parallel worker died)
        self._tp: TensorParallelGroup | None = None
        if config.tensor_parallel_size > 1:  # the workers load their slices meanwhile
            from specbatch.parallel.workers import TensorParallelGroup

            self._tp = TensorParallelGroup(config)
            weakref.finalize(self, self._tp.shutdown)
        try:
            self._build(config, proposer)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, proposer: Proposer | None) -> None:
        models = load_models(config)
        if self._tp is not None:
            self._tp.wait_loaded()
        self.device, self.dtype = models.device, models.dtype
        self.model_path, self.model, self.tokenizer = (
            models.model_path,
            models.model,
            models.tokenizer,
        )
        self.draft_model, self.max_model_len = models.draft, models.max_model_len
        self.speculative_config = models.speculation  # "auto" resolved; None: off
        self.num_kv_blocks = allocate_cache(config, models)
        self.cache = KVCacheManager(
            self.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.runner: ModelRunner | TensorParallelRunner = ModelRunner(
            self.model, config.block_size, capture_graphs(config, models)
        )
        if self._tp is not None:
            from specbatch.parallel.workers import TensorParallelRunner

            self._tp.bind_cache(self.num_kv_blocks)
            self.runner = TensorParallelRunner(self.runner, self._tp)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.speculator = build_speculator(
            self.speculative_config,
            self.draft_model,
            self.num_kv_blocks,
            config.block_size,
            self.generator,
            external=proposer,
            draft_graphs=lambda: capture_draft_graphs(config, models),
            cuda_graphs=self.runner.graphs is not None,
        )
        self.runner.keep_hidden = self.speculator.wants_features
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                models.num_speculative_tokens,
            ),
            self.cache,
            draft_planner=self.speculator.plan if self.speculator.planned else None,
        )
        self.intake = RequestIntake(
            self.tokenizer, self.model.config.vocab_size, self.max_model_len
        )
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self.stats = EngineStats()

    @property
    def proposer(self) -> Proposer | None:
        return self.speculator.proposer

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt: str | SequenceT[int] | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: SequenceT[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request given as text, or as token ids (``prompt`` list or
        ``prompt_token_ids``). Raises ``InvalidRequestError`` (a ``ValueError``) naming the
        field for a duplicate id, an empty or invalid prompt, one that does not fit the
        context, or parameters the model cannot honour."""
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        if not isinstance(request_id, str) or request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")
        params = params or SamplingParams()
        text, token_ids = self.intake.prompt(prompt, prompt_token_ids)
        self.intake.check_params(params, len(token_ids))
        priority = check_priority(priority)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [
            self._new_sequence(request_id, i, token_ids, params, arrival, priority)
            for i in range(params.n)
        ]
        state = RequestState(
            request_id, text, token_ids, params, seqs, self.tokenizer, self.max_model_len
        )
        self.requests[request_id] = state
        for seq in seqs:
            self.scheduler.add(seq)
        self._update_gauges()

    def _new_sequence(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        priority: int,
    ) -> Sequence:
        if params.seed is not None and index > 0:
            # Each of the n completions needs its own randomness; completion 0 equals n=1.
            params = params.clone(seed=hash((params.seed, index)) & 0x7FFF_FFFF_FFFF_FFFF)
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        return Sequence(
            next(self._seq_ids), request_id, index, token_ids, params, arrival, priority, eos
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its cache blocks; False if it is unknown or done."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        state.abort()
        self._release(state)
        self._update_gauges()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Schedule, draft, run one batched forward, verify/sample, update; return the outputs
        of requests that changed (and of those a failing step ended)."""
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        started = time.perf_counter()
        cpu_started = time.process_time()
        try:
            plan = self.scheduler.schedule()
        except Exception as exc:  # the queues may be half-updated: fail what was running
            return self._fail({seq.request_id for seq in self.scheduler.running}, exc)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        for seq in plan.preempted:
            self.speculator.forget(seq)
        if plan.is_empty:
            self._update_gauges()
            return []
        try:
            return self._run(plan, started, cpu_started)
        except TensorParallelError as exc:  # a rank is gone: nothing more can run
            self.dead = f"the engine is down: {exc}"
            self._fail(set(self.requests), exc)
            self.shutdown()
            raise TensorParallelError(self.dead) from exc
        except Exception as exc:
            return self._fail({s.seq.request_id for s in plan.scheduled}, exc)

    def shutdown(self) -> None:
        """Stop a tensor-parallel engine's worker processes (garbage collection does it too);
        nothing to do for one process."""
        if self._tp is not None:
            self._tp.shutdown()

    def _run(
        self, plan: SchedulerOutput, started: float, cpu_started: float
    ) -> list[RequestOutput]:
        scheduled = plan.scheduled
        sampling = [s for s in scheduled if s.completes_sequence]
        proposal = self.speculator.propose(
            [s.seq for s in sampling], [s.num_lookahead for s in sampling]
        )
        drafts = dict(zip((s.seq.seq_id for s in sampling), proposal.tokens, strict=True))
        parents: dict[int, list[int] | None] = {}
        if proposal.has_trees:
            parents = {s.seq.seq_id: proposal.parents_of(i) for i, s in enumerate(sampling)}
        runs = [
            _token_run(s, drafts.get(s.seq.seq_id, []), parents.get(s.seq.seq_id))
            for s in scheduled
        ]
        rows, prompt_rows = _logit_rows(scheduled, drafts)
        logits = self.runner.execute(runs, rows)
        num_sampling_rows = len(rows.run) - len(prompt_rows)
        target_logits = logits[:num_sampling_rows]
        result = self.speculator.verify(target_logits, [s.seq for s in sampling], proposal)
        if result.accepted_nodes is not None:  # before the cache commits a block of the path
            self._move_accepted_paths(sampling, result)
        if self.speculator.wants_features:
            self._hand_features(scheduled, runs, result)
        if prompt_rows:
            self._record_prompt_logprobs(prompt_rows, logits[num_sampling_rows:])
        for s in scheduled:
            seq = s.seq
            self.stats.num_prompt_tokens += max(
                0, min(s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            )
        touched = self._append(sampling, proposal, result, target_logits)
        accepted = {s.seq.seq_id: n for s, n in zip(sampling, result.num_accepted, strict=True)}
        finished = self.scheduler.update_from_output(plan, accepted)
        for i, (s, drafted, n) in enumerate(
            zip(sampling, proposal.tokens, result.num_accepted, strict=True)
        ):
            tree = proposal.parents_of(i)
            depth = None if tree is None else max(node_depths(tree), default=0)
            self.speculator.on_verified(s.seq, len(drafted), n, depth)
        for seq in finished:
            self.speculator.forget(seq)
        seconds = time.perf_counter() - started
        self.speculator.observe_step(
            [(r.start_position, len(r.token_ids)) for r in runs],
            seconds,
            sum(len(t) for t in proposal.tokens),
            self._core_share(seconds, time.process_time() - cpu_started),
        )
        self.stats.num_steps += 1
        self._record_plan()
        self._update_gauges()
        return self._outputs(touched)

    def _core_share(self, seconds: float, cpu_seconds: float) -> float:
        """The process's CPU seconds over the step's wall seconds on a CPU (what tells a step
        slowed by another process from a dear one, see ``spec_decode.step_times``); 1.0 on
        an accelerator, whose steps wait on the device."""
        if self.device.type != "cpu" or seconds <= 0:
            return 1.0
        return cpu_seconds / seconds

    def _move_accepted_paths(self, sampling: list[ScheduledSequence], result: VerifyResult) -> None:
        """A tree's accepted path was computed at the cache slots of its nodes' indices: its
        K/V move to the sequence's next positions (in every cache the step wrote)."""
        block_size = self.config.block_size
        sources: list[int] = []
        targets: list[int] = []
        for s, nodes in zip(sampling, result.accepted_nodes or (), strict=True):
            seq = s.seq
            first = seq.num_computed_tokens + s.num_new_tokens  # where draft 0 was written
            for depth, node in enumerate(nodes):
                if node != depth:
                    for position, out in ((first + node, sources), (first + depth, targets)):
                        block = seq.block_table[position // block_size]
                        out.append(block * block_size + position % block_size)
        self.stats.num_tree_moves += len(sources)
        if sources:
            self.runner.move_slots(sources, targets)

    def _hand_features(
        self, scheduled: list[ScheduledSequence], runs: list[TokenRun], result: VerifyResult
    ) -> None:
        """Give a draft head the target's hidden states of every row of the step, a tree's
        accepted path moved to its positions as its K/V was."""
        kept = self.runner.hidden
        if kept is None:
            return
        hidden, query_start = kept
        paths: dict[int, list[int]] = {}
        if result.accepted_nodes is not None:
            sampling = [s for s in scheduled if s.completes_sequence]
            paths = {
                s.seq.seq_id: nodes
                for s, nodes in zip(sampling, result.accepted_nodes, strict=True)
            }
        order: list[int] = []  # the step's hidden rows, each tree's accepted path moved
        placements = []
        for b, (s, run) in enumerate(zip(scheduled, runs, strict=True)):
            first = int(query_start[b])
            rows = list(range(first, first + len(run.token_ids)))
            nodes = paths.get(s.seq.seq_id)
            for depth, node in enumerate(nodes or ()):
                rows[s.num_new_tokens + depth] = first + s.num_new_tokens + node
            order += rows
            placements.append((s.seq, run.start_position, len(rows)))
        index = torch.tensor(order, dtype=torch.long, device=hidden.device)
        self.speculator.observe_features(placements, hidden.index_select(0, index))

    def _record_plan(self) -> None:
        controller = self.speculator.controller
        if controller is None or not controller.report.candidates:
            return
        report, stats = controller.report, self.stats
        stats.num_planned_steps += 1
        stats.num_drafting_steps += report.drafts > 0
        stats.num_drafts_allotted += report.drafts
        stats.spec_candidates = report.candidates
        stats.spec_seqs_drafting = report.seqs_drafting
        stats.spec_drafts_allotted = report.drafts
        stats.spec_step_seconds = report.step_seconds
        stats.spec_row_seconds = report.row_seconds
        stats.spec_expected_gain = report.expected_gain

    def _append(
        self,
        sampling: list[ScheduledSequence],
        proposal: Proposal,
        result: VerifyResult,
        logits: torch.Tensor,
    ) -> dict[str, RequestState]:
        """Each sampling sequence's emitted tokens (accepted drafts, then the correction or
        bonus token) through its request's stop rules, with their logprobs."""
        touched: dict[str, RequestState] = {}
        first_row = 0
        for i, (s, drafted, accepted, new_tokens) in enumerate(
            zip(sampling, proposal.tokens, result.num_accepted, result.tokens, strict=True)
        ):
            seq = s.seq
            state = self.requests[seq.request_id]
            if drafted:
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += len(drafted)
                self.stats.num_accepted_tokens += accepted
                tree = proposal.parents_of(i)
                self.stats.num_tree_drafts += tree is not None
                depth = len(drafted) if tree is None else max(node_depths(tree))
                self.stats.count_depths(depth, accepted)
            positions = None
            if seq.params.logprobs is not None:  # the root's row, then the path's nodes' rows
                emitted = [first_row] + [first_row + 1 + node for node in result.path(i)]
                rows = logits[emitted[: len(new_tokens)]]
                entries = ranked_logprobs(rows, new_tokens, seq.params.logprobs)
                positions = [state.decode_logprobs(e) for e in entries]
            self.stats.num_generation_tokens += state.append_tokens(
                seq.index, new_tokens, positions
            )
            touched[state.request_id] = state
            first_row += len(drafted) + 1
        return touched

    def _record_prompt_logprobs(
        self, prompt_rows: list[tuple[Sequence, int]], logits: torch.Tensor
    ) -> None:
        # A sequence's rows come in position order; a row recomputed after preemption was
        # recorded already and is skipped. All rows are ranked in one call (one transfer).
        recorded: dict[int, int] = {}
        rows, states, targets, counts = [], [], [], []
        for row, (seq, position) in enumerate(prompt_rows):
            state = self.requests[seq.request_id]
            assert state.prompt_logprobs is not None
            have = recorded.get(seq.seq_id, len(state.prompt_logprobs))
            if position + 1 != have:
                continue
            recorded[seq.seq_id] = have + 1
            rows.append(row)
            states.append(state)
            targets.append(seq.prompt_token_ids[position + 1])
            counts.append(seq.params.prompt_logprobs or 0)
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        ranked = ranked_logprobs(logits.index_select(0, index), targets, counts)
        for state, entries in zip(states, ranked, strict=True):
            assert state.prompt_logprobs is not None
            state.prompt_logprobs.append(state.decode_logprobs(entries))

    # ----------------------------------------------------------------- outputs

    def _outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        # Built before any request is retired: if building one raises, every request of the
        # step is still known to _fail, which answers them all.
        outputs = [output for state in touched.values() if (output := state.output())]
        for request_id, state in touched.items():
            if state.finished:
                self.requests.pop(request_id, None)
                self.stats.num_requests_finished += 1
        return outputs

    def _fail(self, request_ids: set[str], exc: Exception) -> list[RequestOutput]:
        """End the requests of a step that raised, free what they held, report them."""
        logger.error(
            "an engine step failed; its %d request(s) end with an error, the engine goes on",
            len(request_ids),
            exc_info=exc,
        )
        self.stats.num_failed_steps += 1
        message = f"the engine step failed: {type(exc).__name__}: {exc}"
        outputs = []
        for request_id in sorted(request_ids):
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            self.stats.num_requests_failed += 1
            state.fail(message)
            try:
                self._release(state)
                output = state.output()
            except Exception:  # a bug in the release itself: logged, the request answered anyway
                logger.exception("releasing failed request %s failed", request_id)
                output = state.error_output()
            if output is not None:
                outputs.append(output)
        self._update_gauges()
        return outputs

    def _release(self, state: RequestState) -> None:
        for seq in state.seqs:
            self.scheduler.remove(seq)
            self.speculator.forget(seq)

    def _update_gauges(self) -> None:
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        self.stats.kv_cache_usage = self.scheduler.kv_cache_usage


def _token_run(
    s: ScheduledSequence, drafted: list[int], parents: list[int] | None = None
) -> TokenRun:
    """A scheduled sequence's tokens to compute this step, then its drafts (a tree's: in node
    order, with their parents)."""
    seq = s.seq
    tokens = seq.token_ids[seq.num_computed_tokens :][: s.num_new_tokens]
    return TokenRun(
        tokens + drafted, seq.num_computed_tokens, seq.block_table, len(drafted), 0, parents
    )


def _logit_rows(
    scheduled: list[ScheduledSequence], drafts: dict[int, list[int]]
) -> tuple[LogitRows, list[tuple[Sequence, int]]]:
    """Rows whose logits sample or verify tokens (the last prompt/decode token and every
    draft, sequence by sequence), then the rows whose logits give the logprob of prompt token
    ``position + 1``; those are also returned as ``(seq, position)``."""
    runs: list[int] = []
    offsets: list[int] = []
    for b, s in enumerate(scheduled):
        if s.completes_sequence:
            count = 1 + len(drafts.get(s.seq.seq_id, []))
            runs += [b] * count
            offsets += range(s.num_new_tokens - 1, s.num_new_tokens - 1 + count)
    prompt_rows: list[tuple[Sequence, int]] = []
    for b, s in enumerate(scheduled):
        seq = s.seq
        if seq.params.prompt_logprobs is not None and seq.index == 0:
            first = seq.num_computed_tokens
            stop = min(first + s.num_new_tokens, seq.num_prompt_tokens - 1)
            runs += [b] * max(0, stop - first)
            offsets += range(0, stop - first)
            prompt_rows += [(seq, p) for p in range(first, stop)]
    return LogitRows(np.array(runs, dtype=np.int64), np.array(offsets, dtype=np.int64)), prompt_rows
