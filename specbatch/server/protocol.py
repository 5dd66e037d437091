"""OpenAI request bodies (completions, chat completions) and their mapping to SamplingParams.

Types are checked as OpenAI's API does: a wrong type or an out-of-range value is a 400 naming the
field, and so is a field the request models do not define (OpenAI's API refuses unknown
arguments too): a field OpenAI has but specbatch does not implement (``audio``, ``prediction``,
``functions``...) is refused, never silently dropped. vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``structured_outputs``) are accepted.
Messages are lenient: fields a client echoes back from an earlier reply (``refusal``,
``annotations``) are ignored.
"""

from __future__ import annotations

import json
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
from specbatch.sampling_params import OutputKind, SamplingParams, StructuredOutputsParams
from specbatch.server.tools import CLOSE, OPEN, TAGS, WHOLE, calls_schema, describe_tools

MAX_N = 16  # choices per request over HTTP (SamplingParams allows more for library use)
MAX_STOP = 64  # stop strings per request, each at most MAX_STOP_CHARS characters
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024  # entries (OpenAI's own limit is 300); each is applied to every row
MAX_TOOLS = 128  # OpenAI's limit

# A JSON number: no numeric strings, no booleans (SamplingParams checks range and finiteness).
Number = StrictInt | StrictFloat
StopString = Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)]


FunctionName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JSONSchemaFormat(_Strict):
    name: FunctionName
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` field: exactly one kind, as ``StructuredOutputsParams``."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class FunctionDefinition(_Strict):
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _Request(_Strict):
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

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
            structured_outputs=self.constraint(),
        )

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's constraint: ``structured_outputs`` or ``response_format`` (not both)."""
        asked = self.structured_outputs
        answer = self.answer_schema()
        if asked is not None and answer is not None:
            raise InvalidRequestError(
                "give structured_outputs or response_format, not both", "response_format"
            )
        if asked is not None:
            fields = asked.model_dump(by_alias=True, exclude_none=True)
            return StructuredOutputsParams(**fields)
        if answer is None:
            return None
        if answer == {"type": "object"}:
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=answer)

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema ``response_format`` asks for (``{"type": "object"}`` for
        ``json_object``); None for ``text`` or without one."""
        form = self.response_format
        if form is None or form.type == "text":
            if form is not None and form.json_schema is not None:
                raise InvalidRequestError(
                    "response_format.json_schema is only read with type json_schema",
                    "response_format.json_schema",
                )
            return None
        if form.type == "json_object":
            return {"type": "object"}
        if form.json_schema is None:
            raise InvalidRequestError(
                "response_format of type json_schema needs json_schema", "response_format"
            )
        return form.json_schema.schema_ or {"type": "object"}

    def renamed_fields(self) -> dict[str, str]:
        """Where the constraint came from, for its errors (the engine names
        ``structured_outputs``)."""
        if self.response_format is None or self.response_format.type == "text":
            return {}
        schema = "response_format.json_schema.schema"
        return {"structured_outputs.json": schema, "structured_outputs.json_object": schema}


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


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: StrictStr


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self, template_knows_tools: bool) -> dict[str, Any]:
        """The message as chat templates read it. A template that knows tools gets an
        assistant's calls as ``tool_calls`` (arguments as a dict, as Hugging Face templates
        expect); for one that does not, they are written into the content in the format the
        model is told to use (``tools.describe_tools``)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        if not self.tool_calls:
            return message
        calls = [
            {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
            for c in self.tool_calls
        ]
        if template_knows_tools:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": call}
                for c, call in zip(self.tool_calls, calls, strict=True)
            ]
        else:
            written = json.dumps(calls, ensure_ascii=False)
            message["content"] = f"{message['content']}{OPEN}{written}{CLOSE}"
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    def tool_mode(self) -> str:
        """``"none"``, ``"auto"``, ``"required"`` or ``"named"``; checks that ``tool_choice``
        has tools to choose from and names one of them."""
        if self.tool_choice is not None and not self.tools:
            raise InvalidRequestError("tool_choice is only allowed with tools", "tool_choice")
        if not self.tools:
            return "none"
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) < len(names):
            raise InvalidRequestError("tools must have distinct function names", "tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidRequestError(
                    f"tool_choice names {choice.function.name!r}, which is not in tools",
                    "tool_choice",
                )
            return "named"
        return choice or "auto"

    def call_format(self) -> str | None:
        """How the reply's tool calls are read (``tools.TAGS`` or ``tools.WHOLE``; None: the
        reply holds no calls)."""
        mode = self.tool_mode()
        if mode == "none":
            return None
        return TAGS if mode == "auto" and self.answer_schema() is None else WHOLE

    def conversation(self, template_knows_tools: bool = False) -> list[dict[str, Any]]:
        """The messages as the chat template reads them; when tools may be called and the
        template cannot show them, a system message describes them (after the client's own
        system text, when the conversation starts with one)."""
        messages = [m.for_template(template_knows_tools) for m in self.messages]
        if template_knows_tools or self.call_format() is None:
            return messages
        description = describe_tools(self._functions())
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{description}"}
        else:
            messages.insert(0, {"role": "system", "content": description})
        return messages

    def _functions(self) -> list[dict[str, Any]]:
        return [tool.function.model_dump(exclude_none=True) for tool in self.tools or []]

    def template_options(self, template_knows_tools: bool = False) -> tuple[bool, dict[str, Any]]:
        """``(add_generation_prompt, other template variables)``: ``chat_template_kwargs`` may
        set the flag (vLLM's spelling) but not the messages; a template that knows tools gets
        them (unless ``tool_choice`` is ``none``)."""
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
        if template_knows_tools and self.call_format() is not None:
            options["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools or []]
        return add_generation_prompt, options

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's constraint. With ``tool_choice`` ``required`` or named: the JSON list
        of calls valid for the tools; with ``auto`` and a ``response_format`` schema: either
        that list or an answer in the schema; otherwise ``structured_outputs`` or
        ``response_format``."""
        if self.call_format() != WHOLE:
            return super().constraint()
        if self.structured_outputs is not None:
            raise InvalidRequestError(
                "structured_outputs cannot be combined with tool_choice required or named "
                "(nor with a response_format under tools)",
                "structured_outputs",
            )
        mode, answer = self.tool_mode(), self.answer_schema()
        if mode == "auto":
            calls = calls_schema(self._functions(), self.parallel_tool_calls)
            return StructuredOutputsParams(json={"anyOf": [calls, answer]})
        if answer is not None:
            raise InvalidRequestError(
                f"response_format cannot be combined with tool_choice {mode!r}: the reply is "
                "a tool call",
                "response_format",
            )
        choice = self.tool_choice
        only = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return StructuredOutputsParams(
            json=calls_schema(self._functions(), self.parallel_tool_calls, only)
        )

    def field_names(self) -> dict[str, str]:
        """The engine's name of a field -> the name this request used (its prompt is its
        messages; ``max_completion_tokens`` when it set that; ``tools`` or
        ``response_format`` for the constraint they make)."""
        renames = {"prompt": "messages", **self.renamed_fields()}
        if self.call_format() == WHOLE:
            renames["structured_outputs.json"] = "tools"
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
    if first.get("type") == "extra_forbidden" and param:
        return f"{param} is not supported by this server (refused, not ignored)", param
    message = (
        f"{param}: {first.get('msg', 'invalid value')}"
        if param
        else str(first.get("msg", "invalid request"))
    )
    return message, param


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize`` body: a ``prompt``, or chat ``messages`` rendered by the model's
    chat template (with ``add_generation_prompt``, ``chat_template_kwargs`` and ``tools`` as
    in a chat completion); exactly one of the two. ``add_special_tokens`` (BOS where the
    model's configuration adds one) defaults to true for a prompt and false for messages (a
    chat template writes its own)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    return_token_strs: StrictBool = False

    def chat(self) -> ChatCompletionRequest | None:
        """The messages as a chat completion would render them (None: a prompt); refuses a
        body with both or neither, and chat fields beside a prompt."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        if self.messages is None:
            for name in ("chat_template_kwargs", "tools"):
                if getattr(self, name) is not None:
                    raise InvalidRequestError(f"{name} is only allowed with messages", name)
            return None
        return ChatCompletionRequest(
            messages=self.messages,
            n=1,
            top_logprobs=None,
            add_generation_prompt=self.add_generation_prompt,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=self.tools,
        )

    def with_special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class DetokenizeRequest(_Strict):
    """vLLM's ``/detokenize`` body: token ids back to text (special tokens kept)."""

    model: StrictStr | None = None
    tokens: list[StrictInt]
