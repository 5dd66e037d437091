"""OpenAI request bodies (completions, chat completions) and their mapping to SamplingParams.

Types are checked as OpenAI's API does: a wrong type or an out-of-range value is a 400 naming the
field. Fields OpenAI has but specbatch does not implement are refused, not silently ignored;
vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``) are
accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from specbatch.errors import InvalidRequestError
from specbatch.sampling_params import OutputKind, SamplingParams

MAX_N = 16  # choices per request over HTTP (SamplingParams allows more for library use)
MAX_STOP = 64  # stop strings per request, each at most MAX_STOP_CHARS characters
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024  # entries (OpenAI's own limit is 300); each is applied to every row

# A JSON number: no numeric strings, no booleans (SamplingParams checks range and finiteness).
Number = StrictInt | StrictFloat
StopString = Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: Annotated[dict[str, Number], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: StrictStr | None = None
    # vLLM extensions
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    priority: StrictInt = 0

    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int | None
    ) -> SamplingParams:
        """Raises ``InvalidRequestError`` naming the field for out-of-range values."""
        bias = None
        if self.logit_bias is not None:
            bias = {}
            for token, value in self.logit_bias.items():
                if not (token.isascii() and token.isdigit()) or len(token) > 20:
                    raise InvalidRequestError(
                        f"logit_bias keys must be token ids (decimal integers), got {token[:40]!r}",
                        "logit_bias",
                    )
                bias[int(token)] = value
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k == -1 else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            seed=self.seed,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logit_bias=bias,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            output_kind=OutputKind.DELTA if self.stream else OutputKind.FINAL_ONLY,
        )


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def engine_inputs(self) -> tuple[list[str | list[int]], SamplingParams]:
        """The prompts and sampling parameters of the request; raises
        ``InvalidRequestError`` naming the field for what specbatch does not do or allow."""
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if self.echo:
            raise InvalidRequestError("echo is not supported", "echo")
        if self.best_of not in (None, self.n):
            raise InvalidRequestError("best_of must equal n (or be omitted)", "best_of")
        return self.prompts(), self.sampling_params(self.max_tokens, self.logprobs, 16)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (one string or token-id list each); raises
        ``InvalidRequestError`` for an empty list."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be an empty list", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def conversation(self) -> list[dict[str, str]]:
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]

    def template_options(self) -> tuple[bool, dict[str, Any]]:
        """``(add_generation_prompt, other template variables)``: ``chat_template_kwargs`` may
        set the flag (vLLM's spelling) but not the messages."""
        options = dict(self.chat_template_kwargs or {})
        if "messages" in options:
            raise InvalidRequestError(
                "chat_template_kwargs cannot set messages", "chat_template_kwargs"
            )
        add_generation_prompt = options.pop("add_generation_prompt", self.add_generation_prompt)
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequestError(
                "chat_template_kwargs.add_generation_prompt must be true or false",
                "chat_template_kwargs",
            )
        return add_generation_prompt, options

    def field_names(self) -> dict[str, str]:
        """The engine's name of a field -> the name this request used (its prompt is its
        messages; ``max_completion_tokens`` when it set that)."""
        renames = {"prompt": "messages"}
        if self.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return renames

    def top_logprobs_per_token(self) -> int | None:
        """Alternatives per token to return: None without ``logprobs``."""
        if not self.logprobs:
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs

    def chat_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self.sampling_params(max_tokens, self.top_logprobs_per_token(), None)


def in_client_terms(exc: InvalidRequestError, renames: Mapping[str, str]) -> tuple[str, str | None]:
    """An engine error's ``(message, field)`` with the field as the client named it
    (``renames``: the engine's name -> the request's)."""
    param = renames.get(exc.param or "", exc.param)
    message = str(exc)
    if exc.param and param and param != exc.param and message.startswith(exc.param):
        message = param + message[len(exc.param) :]
    return message, param


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def describe_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A pydantic validation failure of a body as ``(message, field)``: the first error, its
    field path as the client wrote it (pydantic's union-member tags left out)."""
    first = errors[0] if errors else {}
    location = []
    for part in first.get("loc", ()):
        if part == "body":
            continue
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part or "-" in part):
            break  # pydantic names the union member it tried: not part of the field path
        location.append(str(part))
    param = ".".join(location) or None
    message = (
        f"{param}: {first.get('msg', 'invalid value')}"
        if param
        else str(first.get("msg", "invalid request"))
    )
    return message, param
