"""A request's n sequences, their text, and the stop rules applied as tokens arrive."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specbatch.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from specbatch.sampling_params import OutputKind, SamplingParams
from specbatch.sequence import FinishReason, Sequence
from specbatch.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Completion:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    sent_text: int = 0  # characters already reported (DELTA mode)
    sent_tokens: int = 0


class RequestState:
    """Turns sequence updates into text, enforces stops, and builds :class:`RequestOutput`."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
        tokenizer: Tokenizer,
        max_model_len: int,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.completions = [
            _Completion(
                s, IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
            )
            for s in seqs
        ]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self._stop_window = max((len(s) for s in params.stop), default=0)
        self.error: str | None = None
        self.error_param: str | None = None  # see ``RequestOutput.error_param``

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.completions]

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    def append_tokens(
        self, index: int, tokens: list[int], logprobs: list[PositionLogprobs] | None = None
    ) -> int:
        """Append tokens to completion ``index`` one by one, stopping at the first stop rule.

        Returns how many were kept (the rest, e.g. accepted drafts past an EOS, are dropped).
        """
        completion = self.completions[index]
        seq = completion.seq
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            if logprobs is not None:
                completion.logprobs.append(logprobs[i])
            self._check_stop(completion, token)
            if seq.is_finished:
                return i + 1
        return len(tokens)

    def _check_stop(self, completion: _Completion, token: int) -> None:
        seq = completion.seq
        if token in seq.eos_token_ids:
            seq.finish(FinishReason.STOP)
        elif token in seq.stop_token_ids:
            seq.finish(FinishReason.STOP, stop_reason=token)
        detokenize = self.params.detokenize
        before = len(completion.text)
        if detokenize:
            completion.text += completion.detokenizer.push([token])
        if seq.is_finished:
            if detokenize:
                completion.text += completion.detokenizer.flush()
            return
        if self.params.stop and self._cut_at_stop_string(completion, before):
            return
        max_tokens = self.params.max_tokens
        if (max_tokens is not None and seq.num_output_tokens >= max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            seq.finish(FinishReason.LENGTH)
            if detokenize:
                completion.text += completion.detokenizer.flush()

    def _cut_at_stop_string(self, completion: _Completion, before: int) -> bool:
        text = completion.text
        search_from = max(0, before - self._stop_window + 1)
        found = [(text.find(s, search_from), s) for s in self.params.stop]
        hits = [(pos, s) for pos, s in found if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        end = pos + len(stop) if self.params.include_stop_str_in_output else pos
        completion.text = text[:end]
        completion.seq.finish(FinishReason.STOP, stop_reason=stop)
        return True

    def abort(self) -> None:
        for completion in self.completions:
            if not completion.seq.is_finished:
                completion.seq.finish(FinishReason.ABORT)

    def fail(self, error: str, param: str | None = None) -> None:
        """A step this request was in raised, or its own ``param`` failed (its constraint):
        it ends now, reporting ``error``."""
        self.error, self.error_param = error, param
        for completion in self.completions:
            if not completion.seq.is_finished:
                completion.seq.finish(FinishReason.ERROR)

    def error_output(self) -> RequestOutput:
        """A final output with no text or tokens, carrying ``error``: what a request gets
        when even its normal output cannot be built."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(c.seq.index, "", [], None, FinishReason.ERROR.value)
                for c in self.completions
            ],
            finished=True,
            metrics=RequestMetrics(arrival_time=self.completions[0].seq.arrival_time),
            error=self.error,
            error_param=self.error_param,
        )

    def output(self) -> RequestOutput | None:
        """The request's output now, or None when its ``output_kind`` has nothing to report."""
        finished = self.finished
        kind = self.params.output_kind
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        outputs = [self._completion_output(c, kind) for c in self.completions]
        if kind is OutputKind.DELTA and not finished and not any(o.token_ids for o in outputs):
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=self.metrics(),
            prompt_logprobs=self.prompt_logprobs,
            error=self.error,
            error_param=self.error_param,
        )

    def _completion_output(self, c: _Completion, kind: OutputKind) -> CompletionOutput:
        seq = c.seq
        # While running, hold back text that could still become the start of a stop string.
        visible = len(c.text)
        if not seq.is_finished and self._stop_window:
            visible = max(c.sent_text, visible - self._stop_window + 1)
        tokens = seq.output_token_ids
        logprobs = c.logprobs if self.params.logprobs is not None else None
        if kind is OutputKind.DELTA:
            text, new_tokens = c.text[c.sent_text : visible], tokens[c.sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[c.sent_tokens :]
            c.sent_text, c.sent_tokens = visible, len(tokens)
        else:
            text, new_tokens = c.text[:visible], tokens
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=new_tokens,
            logprobs=logprobs,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
        )

    def metrics(self) -> RequestMetrics:
        seqs = self.seqs
        first = seqs[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min(
                (s.first_scheduled_time for s in seqs if s.first_scheduled_time), default=None
            ),
            first_token_time=min(
                (s.first_token_time for s in seqs if s.first_token_time), default=None
            ),
            finished_time=max(s.finished_time or 0.0 for s in seqs) if self.finished else None,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=first.num_cached_prompt_tokens,
            num_generation_tokens=sum(s.num_output_tokens for s in seqs),
            num_preemptions=sum(s.num_preemptions for s in seqs),
        )
        for s in seqs:
            metrics.num_drafts += s.spec.num_drafts
            metrics.num_draft_tokens += s.spec.num_draft_tokens
            metrics.num_accepted_tokens += s.spec.num_accepted_tokens
            per_pos = metrics.num_accepted_tokens_per_pos
            per_pos.extend([0] * (len(s.spec.num_accepted_tokens_per_pos) - len(per_pos)))
            for i, count in enumerate(s.spec.num_accepted_tokens_per_pos):
                per_pos[i] += count
        return metrics

    def decode_logprobs(self, entries: dict[int, tuple[float, int]]) -> PositionLogprobs:
        if not self.params.detokenize:
            return {token: Logprob(logprob, rank) for token, (logprob, rank) in entries.items()}
        size = self.tokenizer.vocab_size
        return {
            token: Logprob(logprob, rank, self.tokenizer.decode([token]) if token < size else "")
            for token, (logprob, rank) in entries.items()
        }
