"""What the engine returns per request (vLLM's ``RequestOutput`` / ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token under the raw model distribution, and its rank there."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per generated position: token id -> Logprob (the top-n tokens plus the chosen one).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions. ``text``/``token_ids`` are cumulative unless the
    request asked for ``OutputKind.DELTA``."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings (``time.monotonic`` seconds) and counters of one request.

    Speculative counters use vLLM's names; ``mean_accepted_length`` is the mean number of
    tokens a verify step produced (accepted drafts plus the correction/bonus token).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step, bonus included (1.0 means no draft was ever accepted)."""
        if self.num_drafts == 0:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> float:
        if self.num_draft_tokens == 0:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end, for ``LLM.generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Why the request failed, when a step it was in raised (finish reason "error"); the
    # engine freed its resources and went on serving the others.
    error: str | None = None
    # The request's own field at fault where it failed by its own doing (its constraint's,
    # ``structured_outputs.<kind>``, when the grammar backend hit a limit while generating);
    # None where a step failed
    error_param: str | None = None
