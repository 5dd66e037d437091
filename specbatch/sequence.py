"""One sequence being generated: its tokens, cache position, blocks and finish state."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specbatch.kernels.sampling import SamplingRow
from specbatch.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # the step it was in failed (the engine logged why and went on)


class Constraint(Protocol):
    """A sequence's constraint (``structured.Constraint``) as the engine drives it."""

    error: str | None  # why it failed: then it allows only the end, and its request fails

    def mask(self, drafts: SequenceT[int] = ()) -> np.ndarray:
        """``[vocab]`` bool: the tokens allowed after the committed ones and ``drafts``."""
        ...

    def commit(self, tokens: SequenceT[int]) -> None:
        """The sequence emitted ``tokens``."""
        ...

    def valid_prefix(self, drafts: SequenceT[int]) -> int:
        """How many of ``drafts``, in order, the constraint allows next."""
        ...

    def forced(self) -> list[int]:
        """The constraint's only continuation, in tokens (none where it allows a choice)."""
        ...


@dataclass
class SpecStats:
    """Speculative-decoding counters of one sequence (vLLM's names)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int, depth: int | None = None) -> None:
        """A verify of ``num_proposed`` drafts (a tree's nodes, of ``depth`` levels; a chain's
        depth is its length) that accepted ``num_accepted``."""
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        positions = num_proposed if depth is None else depth
        if len(self.num_accepted_tokens_per_pos) < positions:
            self.num_accepted_tokens_per_pos.extend(
                [0] * (positions - len(self.num_accepted_tokens_per_pos))
            )
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1


@dataclass
class Sequence:
    """A prompt and the tokens generated after it.

    ``num_computed_tokens`` counts the leading tokens whose K/V are valid in the cache; the
    scheduler computes the rest (a prompt, a recomputation after preemption, or the one newest
    token of a decode). ``block_table`` lists this sequence's cache blocks in position order.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    # End-of-sequence ids that finish it (empty with ignore_eos), from the tokenizer.
    eos_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(init=False)
    stop_token_ids: frozenset[int] = field(init=False)  # the request's own stop ids
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache
    block_table: list[int] = field(default_factory=list)
    # the sliding-window layers' blocks (cache/window_cache.py), where the model has its own
    # cache group for them
    window_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    constraint: Constraint | None = None  # structured outputs: masks every sampled position

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.params.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def banned_token_ids(self, extra_outputs: int = 0) -> tuple[int, ...]:
        """Tokens it may not produce while ``min_tokens`` is not reached (counting
        ``extra_outputs`` draft tokens before the row as output)."""
        if self.num_output_tokens + extra_outputs >= self.params.min_tokens:
            return ()
        return tuple(self.eos_token_ids | self.stop_token_ids)

    def sampling_row(self, drafts: list[int] | None = None) -> SamplingRow:
        """The row that samples the token after this sequence's tokens and ``drafts``."""
        drafts = drafts or []
        # The history only matters to penalties: skip copying it otherwise.
        history = self.output_token_ids + drafts if self.params.has_penalties else ()
        return SamplingRow(
            self.params,
            self.prompt_token_ids,
            history,
            position=self.num_tokens + len(drafts),
            banned_token_ids=self.banned_token_ids(len(drafts)),
            allowed=None if self.constraint is None else self.constraint.mask(drafts),
        )

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_time = time.monotonic()
