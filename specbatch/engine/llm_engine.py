"""``LLMEngine``: add requests, step, read outputs. One step batches every running sequence."""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

import numpy as np
import torch

from specbatch.cache.kv_cache_manager import KVCacheManager
from specbatch.config import EngineConfig
from specbatch.engine.logprobs import ranked_logprobs
from specbatch.engine.request_state import RequestState
from specbatch.engine.setup import (
    allocate_cache,
    capture_draft_graphs,
    capture_graphs,
    load_models,
)
from specbatch.errors import ConfigError
from specbatch.kernels.sampling import sample
from specbatch.outputs import RequestOutput
from specbatch.runner.flat_batch import TokenRun, flatten
from specbatch.runner.model_runner import ModelRunner
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler import ScheduledSequence, Scheduler, SchedulerConfig
from specbatch.sequence import Sequence
from specbatch.spec_decode.budget import SpeculationBudget
from specbatch.spec_decode.factory import build_proposer
from specbatch.spec_decode.proposer import DraftRequest, Proposal, Proposer
from specbatch.spec_decode.rejection import VerifyResult, verify


@dataclass
class EngineStats:
    """Engine-wide counters (monotonic) and the latest gauges, for metrics exporters."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_finished: int = 0
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class LLMEngine:
    """Continuous batching over a paged KV cache.

    ``add_request`` queues a request, ``step`` runs one batched forward over every scheduled
    sequence and returns the outputs that changed, ``abort`` stops a request and frees its blocks
    at once. Not thread-safe: drive it from one thread (``AsyncEngine`` does that for asyncio).
    """

    def __init__(self, config: EngineConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        models = load_models(config)
        self.device, self.dtype = models.device, models.dtype
        self.model_path, self.model, self.tokenizer = (
            models.model_path,
            models.model,
            models.tokenizer,
        )
        self.draft_model, self.max_model_len = models.draft, models.max_model_len
        self.speculative_config = spec = config.speculative_config
        self.num_kv_blocks = allocate_cache(config, models)
        self.cache = KVCacheManager(
            self.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                models.num_speculative_tokens,
            ),
            self.cache,
        )
        self.runner = ModelRunner(self.model, capture_graphs(config, models))
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.proposer: Proposer | None = None
        self.budget: SpeculationBudget | None = None
        if spec is not None and spec.adaptive_k:
            if self.runner.graphs is None:
                self.budget = SpeculationBudget()
            else:
                # Graph replays pad every decode to k drafts: fewer drafts would save nothing.
                warnings.warn(
                    "adaptive_k is ignored while CUDA graphs are on (every decode step is "
                    "padded to k drafts); pass enforce_eager=True to use it",
                    stacklevel=2,
                )
        if spec is not None:
            self.proposer = build_proposer(
                spec,
                self.draft_model,
                self.num_kv_blocks,
                config.block_size,
                self.generator,
                external=proposer,
                draft_graphs=lambda: capture_draft_graphs(config, models),
            )
        elif proposer is not None:
            raise ConfigError("a proposer needs speculative_config={'method': 'external', ...}")
        self.requests: dict[str, RequestState] = {}
        self._seq_owner: dict[int, tuple[RequestState, int]] = {}
        self._seq_ids = itertools.count()
        self.stats = EngineStats()

    @classmethod
    def from_args(cls, **kwargs: object) -> LLMEngine:
        return cls(EngineConfig(**kwargs))  # type: ignore[arg-type]

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
        ``prompt_token_ids``). Raises ``ValueError`` for a duplicate id, an empty prompt, or a
        prompt that does not fit the context."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, token_ids = self._prompt_tokens(prompt, prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [
            self._new_sequence(request_id, i, token_ids, params, arrival, priority)
            for i in range(params.n)
        ]
        state = RequestState(
            request_id, text, token_ids, params, seqs, self.tokenizer, self.max_model_len
        )
        self.requests[request_id] = state
        for i, seq in enumerate(seqs):
            self._seq_owner[seq.seq_id] = (state, i)
            self.scheduler.add(seq)

    def _prompt_tokens(
        self, prompt: str | SequenceT[int] | None, prompt_token_ids: SequenceT[int] | None
    ) -> tuple[str | None, list[int]]:
        if prompt_token_ids is None and prompt is not None and not isinstance(prompt, str):
            prompt_token_ids, prompt = prompt, None
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            vocab = self.model.config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            raise ValueError("give a prompt string or prompt_token_ids")
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but the context holds {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        return (prompt if isinstance(prompt, str) else None), ids

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
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Schedule, draft, run one batched forward, verify/sample, update; return the outputs
        of requests that changed."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        for seq in plan.preempted:
            self._forget_drafts(seq)
        if plan.is_empty:
            self._update_gauges()
            return []
        scheduled = plan.scheduled
        sampling = [s for s in scheduled if s.completes_sequence]
        proposal, proposer_seconds = self._propose(
            sampling, sum(s.num_new_tokens for s in scheduled)
        )
        drafts = dict(zip((s.seq.seq_id for s in sampling), proposal.tokens, strict=True))
        # Under CUDA graphs a decode-only step with any draft pads every decode to k drafts
        # (one graph shape, q = k + 1); a step without drafts stays at q = 1. Steps that cannot
        # replay anyway (a prefill chunk, more sequences than the ladder) are not padded.
        graphs = self.runner.graphs
        uniform_k = 0
        if (
            graphs is not None
            and any(proposal.tokens)
            and len(scheduled) <= graphs.batch_sizes[-1]
            and all(s.num_new_tokens == 1 for s in scheduled)
        ):
            uniform_k = self.scheduler.config.num_speculative_tokens
        batch = flatten(
            [self._token_run(s, drafts, uniform_k) for s in scheduled], self.config.block_size
        )
        rows, prompt_rows = self._logit_rows(scheduled, batch.query_start, drafts)
        logits = self.runner.forward(
            batch, np.array(rows + [r for _, r, _ in prompt_rows], dtype=np.int64)
        )
        target_logits = logits[: len(rows)]
        result = self._verify(target_logits, sampling, proposal)
        if prompt_rows:
            self._record_prompt_logprobs(prompt_rows, logits[len(rows) :])
        touched = self._update(scheduled, sampling, proposal.tokens, result, target_logits)
        if self.budget is not None:
            self.budget.observe_step(
                batch.num_tokens,
                time.perf_counter() - started - proposer_seconds,
                sum(len(t) for t in proposal.tokens),
                proposer_seconds,
            )
        self.stats.num_steps += 1
        self._update_gauges()
        return self._outputs(touched)

    def _token_run(
        self, s: ScheduledSequence, drafts: dict[int, list[int]], uniform_k: int
    ) -> TokenRun:
        seq = s.seq
        tokens = seq.token_ids[seq.num_computed_tokens :][: s.num_new_tokens]
        drafted = drafts.get(seq.seq_id, [])
        fillers = uniform_k - len(drafted)
        if fillers > 0:
            # Uniform query lengths let the step replay a CUDA graph. Fillers get no cache slot
            # (they write nothing), come after every real token (no real row attends to them)
            # and are never verified: their rows are computed and dropped.
            return TokenRun(
                tokens + drafted + [seq.last_token_id] * fillers,
                seq.num_computed_tokens,
                seq.block_table,
                num_unslotted=fillers,
            )
        return TokenRun(tokens + drafted, seq.num_computed_tokens, seq.block_table)

    def _propose(
        self, sampling: list[ScheduledSequence], base_tokens: int
    ) -> tuple[Proposal, float]:
        """Drafts for every sampling sequence that reserved lookahead slots (others: none);
        with ``adaptive_k``, as many of those slots as the budget gives it this step. Also the
        seconds the proposer took."""
        tokens: list[list[int]] = [[] for _ in sampling]
        wanted = [i for i, s in enumerate(sampling) if s.num_lookahead > 0]
        if self.proposer is None or not wanted:
            return Proposal(tokens), 0.0
        allowed = [sampling[i].num_lookahead for i in wanted]
        if self.budget is not None:
            allowed = self.budget.allot(
                [sampling[i].seq.seq_id for i in wanted], allowed, base_tokens
            )
            kept = [(i, a) for i, a in zip(wanted, allowed, strict=True) if a]
            if not kept:
                return Proposal(tokens), 0.0
            wanted, allowed = [i for i, _ in kept], [a for _, a in kept]
        started = time.perf_counter()
        proposal = self.proposer.propose(
            [DraftRequest(sampling[i].seq, a) for i, a in zip(wanted, allowed, strict=True)]
        )
        seconds = time.perf_counter() - started
        probs, row = proposal.draft_probs, 0
        q_rows: list[int] = []
        for i, drafted, most in zip(wanted, proposal.tokens, allowed, strict=True):
            tokens[i] = drafted[:most]  # a proposer may not exceed its slots: cut, q rows too
            q_rows += range(row, row + len(tokens[i]))
            row += len(drafted)
        if probs is not None and len(q_rows) < row:
            probs = probs[q_rows]
        return Proposal(tokens, probs), seconds

    def _logit_rows(
        self,
        scheduled: list[ScheduledSequence],
        query_start: np.ndarray,
        drafts: dict[int, list[int]],
    ) -> tuple[list[int], list[tuple[Sequence, int, int]]]:
        """Rows whose logits sample or verify tokens (the last prompt/decode token and every
        draft, sequence by sequence), then ``(seq, row, position)`` of rows whose logits give the
        logprob of prompt token ``position + 1``."""
        rows: list[int] = []
        prompt_rows: list[tuple[Sequence, int, int]] = []
        for b, s in enumerate(scheduled):
            if s.completes_sequence:
                last = int(query_start[b]) + s.num_new_tokens - 1
                rows.extend(range(last, last + 1 + len(drafts.get(s.seq.seq_id, []))))
            if s.seq.params.prompt_logprobs is not None and s.seq.index == 0:
                first = s.seq.num_computed_tokens
                stop = min(first + s.num_new_tokens, s.seq.num_prompt_tokens - 1)
                prompt_rows += [
                    (s.seq, int(query_start[b]) + p - first, p) for p in range(first, stop)
                ]
        return rows, prompt_rows

    def _verify(
        self, logits: torch.Tensor, sampling: list[ScheduledSequence], proposal: Proposal
    ) -> VerifyResult:
        if not any(proposal.tokens):  # the plain, non-speculative path
            sampled = sample(
                logits, [s.seq.sampling_row() for s in sampling], self.generator
            ).tolist()
            return VerifyResult([0] * len(sampling), [[t] for t in sampled])
        rows = [
            s.seq.sampling_row(drafted[:j])
            for s, drafted in zip(sampling, proposal.tokens, strict=True)
            for j in range(len(drafted) + 1)
        ]
        return verify(logits, rows, proposal.tokens, proposal.draft_probs, self.generator)

    def _record_prompt_logprobs(
        self, prompt_rows: list[tuple[Sequence, int, int]], logits: torch.Tensor
    ) -> None:
        # A sequence's rows come in position order; a row recomputed after preemption was
        # recorded already and is skipped. All rows are ranked in one call (one transfer).
        recorded: dict[int, int] = {}
        rows, states, targets, counts = [], [], [], []
        for row, (seq, _, position) in enumerate(prompt_rows):
            state, _ = self._seq_owner[seq.seq_id]
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

    def _update(
        self,
        scheduled: list[ScheduledSequence],
        sampling: list[ScheduledSequence],
        drafts: list[list[int]],
        result: VerifyResult,
        logits: torch.Tensor,
    ) -> dict[str, RequestState]:
        """Advance every scheduled sequence: computed tokens (accepted drafts included), new
        tokens through the stop rules, cache rollback of rejected drafts, prefix commits."""
        touched: dict[str, RequestState] = {}
        verified = {s.seq.seq_id: i for i, s in enumerate(sampling)}
        first_row = np.cumsum([0] + [len(d) + 1 for d in drafts])
        for s in scheduled:
            seq = s.seq
            self.stats.num_prompt_tokens += max(
                0, min(s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            )
            seq.num_computed_tokens += s.num_new_tokens
            i = verified.get(seq.seq_id)
            if i is not None:
                touched_state = self._apply_verified(
                    seq,
                    drafts[i],
                    result.num_accepted[i],
                    result.tokens[i],
                    logits[int(first_row[i]) :],
                )
                touched[touched_state.request_id] = touched_state
            self.cache.commit(seq)
            if seq.is_finished:
                self._finish(seq)
        return touched

    def _apply_verified(
        self,
        seq: Sequence,
        drafted: list[int],
        accepted: int,
        new_tokens: list[int],
        logits: torch.Tensor,
    ) -> RequestState:
        state, index = self._seq_owner[seq.seq_id]
        seq.num_computed_tokens += accepted  # accepted drafts' K/V are valid
        if drafted:
            seq.spec.record(len(drafted), accepted)
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += len(drafted)
            self.stats.num_accepted_tokens += accepted
            if self.budget is not None:
                self.budget.observe_verify(seq.seq_id, len(drafted), accepted)
        positions = None
        if seq.params.logprobs is not None:  # row j of the step emitted token j
            entries = ranked_logprobs(logits[: len(new_tokens)], new_tokens, seq.params.logprobs)
            positions = [state.decode_logprobs(e) for e in entries]
        self.stats.num_generation_tokens += state.append_tokens(index, new_tokens, positions)
        if self.proposer is not None:
            self.proposer.on_verified(seq)
        if not seq.is_finished:
            # Rollback: keep the blocks the next step needs (its token plus lookahead) only.
            self.cache.truncate(seq, seq.num_tokens + self.scheduler.lookahead(seq))
        return state

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._forget_drafts(seq)

    def _forget_drafts(self, seq: Sequence) -> None:
        """The sequence's cache is gone (finished, aborted, preempted): so is its draft state."""
        if self.proposer is not None:
            self.proposer.forget(seq)
        if self.budget is not None:
            self.budget.forget(seq.seq_id)

    def _outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        outputs = []
        for request_id, state in touched.items():
            output = state.output()
            if output is not None:
                outputs.append(output)
            if state.finished:
                self.requests.pop(request_id, None)
                self._forget(state)
                self.stats.num_requests_finished += 1
        return outputs

    def _release(self, state: RequestState) -> None:
        for seq in state.seqs:
            self._finish(seq)
        self._forget(state)

    def _forget(self, state: RequestState) -> None:
        for seq in state.seqs:
            self._seq_owner.pop(seq.seq_id, None)

    def _update_gauges(self) -> None:
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        self.stats.kv_cache_usage = self.cache.usage
