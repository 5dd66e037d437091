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
from typing import TYPE_CHECKING

import numpy as np
import torch

from specbatch.cache.kv_cache_manager import KVCacheManager
from specbatch.cache.window_cache import HybridKVCache, WindowCacheManager
from specbatch.config import EngineConfig
from specbatch.engine.intake import RequestIntake, check_priority
from specbatch.engine.logprobs import ranked_logprobs
from specbatch.engine.request_state import RequestState
from specbatch.engine.setup import allocate_cache, capture_draft_graphs, capture_graphs, load_models
from specbatch.engine.stats import EngineStats
from specbatch.errors import InvalidRequestError, TensorParallelError
from specbatch.outputs import RequestOutput
from specbatch.parallel.world import check_world, launched_world
from specbatch.runner.flat_batch import LogitRows, TokenRun
from specbatch.runner.model_runner import ModelRunner
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput
from specbatch.sequence import Sequence
from specbatch.spec_decode.control.step_times import StepClock
from specbatch.spec_decode.factory import build_speculator
from specbatch.spec_decode.plan import DraftPlan
from specbatch.spec_decode.proposers.base import Proposal, Proposer
from specbatch.spec_decode.verification.chain import VerifyResult

if TYPE_CHECKING:
    from specbatch.parallel.workers import TensorParallelGroup, TensorParallelRunner

logger = logging.getLogger("specbatch")


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
        world = launched_world()  # torchrun's: rank 0 is this engine, the others its workers
        check_world(config.tensor_parallel_size, world)
        if world is not None and world.rank != 0:
            from specbatch.parallel.workers import run_launched_worker

            run_launched_worker(config, world)  # ends the process with rank 0's engine
        if config.tensor_parallel_size > 1:  # the workers load their slices meanwhile
            from specbatch.parallel.workers import TensorParallelGroup

            self._tp = TensorParallelGroup(config, world)
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
        self.weight_mode = models.weight_mode  # quantization="auto" resolved
        self.model_path, self.model, self.tokenizer = (
            models.model_path,
            models.model,
            models.tokenizer,
        )
        self.draft_model, self.max_model_len = models.draft, models.max_model_len
        self.speculative_config = models.speculation  # "auto" resolved; None: off
        self.num_kv_blocks, window_blocks = allocate_cache(config, models)
        self.cache: KVCacheManager | HybridKVCache = KVCacheManager(
            self.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        if window_blocks is not None:  # the sliding layers keep their window only
            window = WindowCacheManager(
                window_blocks,
                config.block_size,
                config.enable_prefix_caching,
                self.model.config.sliding_window or 1,
            )
            self.cache = HybridKVCache(self.cache, window)
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
                drafts_after_prompts=self.speculator.adaptive,
            ),
            self.cache,
            draft_planner=self.speculator.plan if self.speculator.proposer else None,
        )
        self.intake = RequestIntake(
            self.tokenizer,
            self.model.config.vocab_size,
            self.max_model_len,
            config.structured_outputs_backend,
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
        grammar = self.intake.grammar(params, len(token_ids))
        priority = check_priority(priority)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [
            self._new_sequence(request_id, i, token_ids, params, arrival, priority)
            for i in range(params.n)
        ]
        if grammar is not None:
            for seq in seqs:
                seq.constraint = self.intake.constraints.new(grammar)
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
        clock = self.speculator.clock()
        try:
            out = self.scheduler.schedule()
        except Exception as exc:  # the queues may be half-updated: fail what was running
            return self._fail({seq.request_id for seq in self.scheduler.running}, exc)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        for seq in out.preempted:
            self.speculator.forget(seq)
        if out.is_empty:
            self._update_gauges()
            return []
        try:
            return self._run(out, clock)
        except TensorParallelError as exc:  # a rank is gone: nothing more can run
            self.dead = f"the engine is down: {exc}"
            self._fail(set(self.requests), exc, "the engine is down")
            self.shutdown()
            raise TensorParallelError(self.dead) from exc
        except Exception as exc:
            return self._fail({s.seq.request_id for s in out.scheduled}, exc)

    def check_ranks(self) -> None:
        """Between steps: raise ``TensorParallelError`` (and the engine is down) once a
        tensor-parallel rank is known to be gone, so an idle engine's owner hears of it
        without waiting for a request."""
        if self._tp is None or self.dead is not None:
            return
        try:
            self._tp.check()
        except TensorParallelError as exc:
            self.dead = f"the engine is down: {exc}"
            self.shutdown()
            raise TensorParallelError(self.dead) from exc

    def shutdown(self) -> None:
        """Stop a tensor-parallel engine's worker processes (garbage collection does it too);
        nothing to do for one process."""
        if self._tp is not None:
            self._tp.shutdown()

    def _run(self, out: SchedulerOutput, clock: StepClock) -> list[RequestOutput]:
        scheduled = out.scheduled
        sampling = [s for s in scheduled if s.completes_sequence]
        plan = out.draft_plan
        assert plan is None or isinstance(plan, DraftPlan)
        proposal = self.speculator.propose(plan, sampling)
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
        self.speculator.settle(self.runner, scheduled, runs, result)
        if prompt_rows:
            self._record_prompt_logprobs(prompt_rows, logits[num_sampling_rows:])
        for s in scheduled:
            seq = s.seq
            self.stats.num_prompt_tokens += max(
                0, min(s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            )
        touched = self._append(sampling, proposal, result, target_logits)
        broken = {
            s.seq.request_id: s.seq.constraint.error
            for s in sampling
            if s.seq.constraint is not None and s.seq.constraint.error is not None
        }
        for request_id in broken:
            touched.pop(request_id, None)
        accepted = {s.seq.seq_id: n for s, n in zip(sampling, result.num_accepted, strict=True)}
        finished = self.scheduler.update_from_output(out, accepted)
        counters = self.speculator.learn(plan, sampling, proposal, result, finished, runs, clock)
        self.stats.add_speculation(counters)
        self.stats.num_steps += 1
        self._update_gauges()
        outputs = self._outputs(touched)
        for request_id, error in broken.items():
            logger.warning("request %s ends: its constraint failed: %s", request_id, error)
            state = self.requests.get(request_id)
            constraint = None if state is None else state.params.structured_outputs
            param = "structured_outputs" + ("" if constraint is None else f".{constraint.kind}")
            outputs += self._end_with_error(
                {request_id}, f"{param}: the constraint failed while generating: {error}", param
            )
        return outputs

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
        for i, (s, drafted, new_tokens) in enumerate(
            zip(sampling, proposal.tokens, result.tokens, strict=True)
        ):
            seq = s.seq
            state = self.requests[seq.request_id]
            positions = None
            if seq.params.logprobs is not None:  # the root's row, then the path's nodes' rows
                emitted = [first_row] + [first_row + 1 + node for node in result.path(i)]
                rows = logits[emitted[: len(new_tokens)]]
                entries = ranked_logprobs(rows, new_tokens, seq.params.logprobs)
                positions = [state.decode_logprobs(e) for e in entries]
            kept = state.append_tokens(seq.index, new_tokens, positions)
            if seq.constraint is not None and not seq.is_finished:
                seq.constraint.commit(new_tokens[:kept])
            self.stats.num_generation_tokens += kept
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

    def _fail(
        self, request_ids: set[str], exc: Exception, after: str = "the engine goes on"
    ) -> list[RequestOutput]:
        """End the requests of a step that raised, free what they held, report them."""
        logger.error(
            "an engine step failed; its %d request(s) end with an error, %s",
            len(request_ids),
            after,
            exc_info=exc,
        )
        self.stats.num_failed_steps += 1
        return self._end_with_error(
            request_ids, f"the engine step failed: {type(exc).__name__}: {exc}"
        )

    def _end_with_error(
        self, request_ids: set[str], message: str, param: str | None = None
    ) -> list[RequestOutput]:
        """End these requests with ``message`` (``param``: their own field at fault, see
        ``RequestOutput.error_param``), free what they held, report them."""
        outputs = []
        for request_id in sorted(request_ids):
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            self.stats.num_requests_failed += 1
            state.fail(message, param)
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
        store = self.speculator.store_stats()
        if store is not None:
            stats = self.stats
            stats.suffix_store_tokens, stats.suffix_store_requests = store.tokens, store.documents
            stats.suffix_lookups, stats.suffix_hits = store.lookups, store.hits


def _token_run(
    s: ScheduledSequence, drafted: list[int], parents: list[int] | None = None
) -> TokenRun:
    """A scheduled sequence's tokens to compute this step, then its drafts (a tree's: in node
    order, with their parents)."""
    seq = s.seq
    tokens = seq.token_ids[seq.num_computed_tokens :][: s.num_new_tokens]
    return TokenRun(
        tokens + drafted,
        seq.num_computed_tokens,
        seq.block_table,
        len(drafted),
        0,
        parents,
        seq.window_table or None,  # the sliding layers' own group, where the model has one
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
