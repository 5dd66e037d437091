"""Admitting a request: its prompt as valid token ids, its parameters checked against the model.

Everything a request can get wrong is found here, before it reaches the scheduler, and raised
as :class:`~specbatch.errors.InvalidRequestError` naming the field: text that is not valid
Unicode, token ids outside the vocabulary, a prompt that leaves no room in the context, logit
biases or stop ids the model does not have, and requests whose logprobs would take unbounded
memory. A request that passes cannot fail a step on account of its input.
"""

from __future__ import annotations

from collections.abc import Sequence

from specbatch.errors import InvalidRequestError
from specbatch.sampling_params import SamplingParams
from specbatch.structured.grammar import CompiledGrammar
from specbatch.structured.manager import Constraints
from specbatch.tokenizer import Tokenizer

# Logprob entries (positions x (top-n + the chosen token) x completions) one request may hold.
MAX_LOGPROB_ENTRIES = 1 << 20
# Normalisation can merge characters (a letter and a combining accent become one), so a text's
# characters bound its tokens only within this factor.
_NORMALISATION_SLACK = 4


class RequestIntake:
    """Prompt and parameter checks for one model (its tokenizer, vocabulary and context)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        structured_outputs_backend: str = "llguidance",
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.constraints = Constraints(tokenizer, vocab_size, structured_outputs_backend)

    def tokenize(
        self, text: str, param: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        """The token ids of a text prompt, refusing invalid or hopelessly long text before the
        tokenizer spends time on it."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"{param} must be a string", param)
        self.check_length(len(text), param)
        # (the tokenizer refuses text that is not valid Unicode)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: Sequence[int], param: str = "tokens") -> str:
        """The text of token ids (special tokens kept), refusing ids outside the vocabulary."""
        return self.tokenizer.decode(self._token_ids(ids, param))

    def check_length(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse text of ``num_chars`` characters that cannot fit the context however it is
        tokenized (no token covers more than ``max_token_chars`` characters), before any
        tokenizer or template spends time on it."""
        if num_chars <= _NORMALISATION_SLACK * self.max_model_len:
            return  # cheap: no need to know the longest token
        limit = _NORMALISATION_SLACK * self.tokenizer.max_token_chars * self.max_model_len
        if num_chars > limit:
            raise InvalidRequestError(
                f"{param} has {num_chars} characters, more than the context of "
                f"{self.max_model_len} tokens can hold",
                param,
            )

    def prompt(
        self,
        prompt: str | Sequence[int] | None,
        prompt_token_ids: Sequence[int] | None,
        param: str = "prompt",
    ) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt given as text, token ids, or both (ids
        win: the text is then only reported back)."""
        if prompt_token_ids is None and prompt is not None and not isinstance(prompt, str):
            prompt_token_ids, prompt = prompt, None
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequestError(f"{param} must be a string or a list of token ids", param)
        if prompt_token_ids is not None:
            ids = self._token_ids(prompt_token_ids, param)
        elif prompt is not None:
            ids = self.tokenize(prompt, param)
        else:
            raise InvalidRequestError("give a prompt string or prompt_token_ids", param)
        if not ids:
            raise InvalidRequestError(f"{param} is empty (0 tokens)", param)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"{param} has {len(ids)} tokens, but the context holds {self.max_model_len} "
                "(prompt plus at least one generated token)",
                param,
            )
        return prompt, ids

    def _token_ids(self, ids: Sequence[int], param: str) -> list[int]:
        if isinstance(ids, (str, bytes)):
            raise InvalidRequestError(f"{param} token ids must be a list of integers", param)
        out = list(ids)
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in out):
            raise InvalidRequestError(f"{param} token ids must be integers in [0, {vocab})", param)
        return out

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """What ``SamplingParams`` cannot check alone: ids against the vocabulary, memory."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams", "params")
        vocab = self.vocab_size
        for token in params.logit_bias or {}:
            if token >= vocab:
                raise InvalidRequestError(
                    f"logit_bias names token {token}, outside the vocabulary of {vocab}",
                    "logit_bias",
                )
        for token in params.stop_token_ids:
            if token >= vocab:
                raise InvalidRequestError(
                    f"stop_token_ids names token {token}, outside the vocabulary of {vocab}",
                    "stop_token_ids",
                )
        if params.structured_outputs is not None and params.ignore_eos:
            raise InvalidRequestError(
                "structured_outputs cannot be combined with ignore_eos: a complete constraint "
                "allows only the end of the sequence",
                "ignore_eos",
            )
        room = self.max_model_len - num_prompt_tokens
        positions = min(params.max_tokens or room, room)
        entries = params.n * positions * (params.logprobs + 1 if params.logprobs is not None else 0)
        if entries > MAX_LOGPROB_ENTRIES:
            raise InvalidRequestError(
                f"n x max_tokens x (logprobs + 1) is {entries} logprob entries; at most "
                f"{MAX_LOGPROB_ENTRIES} per request (lower n, max_tokens or logprobs)",
                "logprobs",
            )

    def grammar(self, params: SamplingParams, num_prompt_tokens: int) -> CompiledGrammar | None:
        """The request's constraint compiled for this model (None without one);
        ``InvalidRequestError`` naming the field when it does not compile, and naming
        ``max_tokens`` when no output it allows fits in ``max_tokens`` (or the context)."""
        if params.structured_outputs is None:
            return None
        compiled = self.constraints.compile(params.structured_outputs)
        room = self.max_model_len - num_prompt_tokens
        most = min(params.max_tokens or room, room)
        if compiled.min_tokens > most:
            raise InvalidRequestError(
                f"max_tokens: the constraint needs at least {compiled.min_tokens} tokens, but "
                f"{'max_tokens' if most == params.max_tokens else 'the context'} leaves room "
                f"for {most}",
                "max_tokens",
            )
        return compiled


def check_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 2**63:
        raise InvalidRequestError(
            f"priority must be an int64 integer, got {priority!r}", "priority"
        )
    return priority
