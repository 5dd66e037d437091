"""The Responses API (``/v1/responses``): its bodies, their mapping onto a chat completion, the
output items and streamed events it answers with, and the store behind
``previous_response_id``.

A request is read strictly (an unknown field, item type or content part is a 400 naming it),
then mapped onto a :class:`ChatCompletionRequest`: ``instructions`` as the first system
message, ``input`` items as messages (a ``function_call`` item as an assistant's call, its
``function_call_output`` as the tool's reply), ``text.format`` as ``response_format``, function
tools and ``tool_choice`` as chat's, ``max_output_tokens`` as ``max_tokens``. From there the
chat path does the rest (template, tools, constraints, sampling), so the two endpoints give the
same tokens for the same conversation.

The output is built by :class:`OutputBuilder` from the completion's text as it streams: text
becomes an assistant ``message`` item, each tool call a ``function_call`` item, and every
change an event (``response.output_text.delta``, ``response.function_call_arguments.delta``,
...). A reply that does not stream is the same builder fed the whole text, its events dropped,
so a streamed response's final object (``response.completed``) is the one the same request gets
whole.

``previous_response_id`` continues a stored response: its whole conversation (its own
predecessors' included; instructions are not carried over, as OpenAI's) and its output come
before the new input. The store keeps the latest ``capacity`` responses whose request did not
set ``store: false``, the oldest dropped first; with a capacity of 0 it is off, and naming a
previous response is a 400 that says so.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from specbatch.errors import InvalidRequestError
from specbatch.server.protocol import (
    MAX_TOOLS,
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    JSONSchemaFormat,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    Number,
    ResponseFormat,
    Tool,
    _Strict,
)
from specbatch.server.tools import WHOLE, CallReader, ToolCall

MAX_INPUT_ITEMS = 4096  # items per request (each a message, a call or a call's output)
MAX_METADATA = 16  # OpenAI's limit: keys of at most 64 characters, values of at most 512
DEFAULT_STORE = 256  # responses kept for previous_response_id (serve --max-stored-responses)


class TextPart(_Strict):
    """A message's text: ``input_text`` (a user's, a system's) or ``output_text`` (an
    assistant's, echoed back from an earlier response; its annotations and logprobs are
    read and dropped)."""

    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | Annotated[list[TextPart], Field(max_length=MAX_INPUT_ITEMS)]
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> str | None:
    """An input item's kind: its ``type``, ``message`` where it has none (the SDK's
    ``EasyInputMessage``: a role and content)."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionDefinition):
    """A function tool as the Responses API writes it: chat's definition, flat, typed."""

    type: Literal["function"]


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or a JSON schema (named, as OpenAI's)."""

    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]],
    Field(max_length=MAX_METADATA),
]


class ResponsesRequest(_Strict):
    model: StrictStr | None = None
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: StrictStr | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool = False
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    metadata: Metadata | None = None
    user: StrictStr | None = None
    truncation: Literal["disabled"] | None = None
    priority: StrictInt = 0  # vLLM's extension, as in chat

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat(self, history: list[Any]) -> ChatCompletionRequest:
        """The chat completion this request is, after the ``history`` items (a previous
        response's conversation and output); raises ``InvalidRequestError`` naming the field
        (in this request's terms) for a conversation chat cannot take."""
        messages = []
        if self.instructions is not None:
            messages.append(ChatMessage(role="system", content=self.instructions))
        messages += _messages([*history, *self.items()], len(history))
        if not messages:
            raise InvalidRequestError("input has no messages", "input")
        tools = None
        if self.tools is not None:
            tools = [
                Tool(
                    type="function",
                    function=FunctionDefinition(**t.model_dump(exclude={"type"})),
                )
                for t in self.tools
            ]
        choice: Literal["none", "auto", "required"] | NamedToolChoice | None
        if isinstance(self.tool_choice, FunctionChoice):
            named = NamedFunction(name=self.tool_choice.name)
            choice = NamedToolChoice(type="function", function=named)
        else:
            choice = self.tool_choice
        return ChatCompletionRequest(
            messages=messages,
            n=1,
            top_logprobs=None,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format(),
            priority=self.priority,
        )

    def _response_format(self) -> ResponseFormat | None:
        form = None if self.text is None else self.text.format
        if form is None or form.type == "text":
            return None
        if form.type == "json_object":
            return ResponseFormat(type="json_object")
        if form.name is None:
            raise InvalidRequestError("text.format of type json_schema needs a name", "text.format")
        schema = JSONSchemaFormat.model_validate(
            {
                "name": form.name,
                "description": form.description,
                "schema": form.schema_,
                "strict": form.strict,
            }
        )
        return ResponseFormat(type="json_schema", json_schema=schema)

    def field_names(self, chat: ChatCompletionRequest) -> dict[str, str]:
        """The engine's and chat's names of a field -> this request's (see
        ``ChatCompletionRequest.field_names``)."""
        renames = {
            "prompt": "input",
            "messages": "input",
            "max_tokens": "max_output_tokens",
            "response_format": "text.format",
            "response_format.json_schema": "text.format",
            "structured_outputs.json": "text.format.schema",
            "structured_outputs.json_object": "text.format",
        }
        if chat.call_format() == WHOLE:  # the constraint is the tools' calls
            renames["structured_outputs.json"] = "tools"
        return renames

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response repeats them."""
        form = None if self.text is None else self.text.format
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": dict(self.metadata or {}),
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {
                "format": {"type": "text"}
                if form is None
                else form.model_dump(by_alias=True, exclude_none=True)
            },
            "tool_choice": (
                self.tool_choice.model_dump()
                if isinstance(self.tool_choice, FunctionChoice)
                else self.tool_choice or "auto"
            ),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }


def _messages(items: list[Any], first_own: int) -> list[ChatMessage]:
    """Input items as chat messages: consecutive ``function_call`` items become one
    assistant message's calls (after the assistant's text where one precedes them), each
    ``function_call_output`` the tool's reply to a call made before it. Items from
    ``first_own`` on are this request's (errors name them as ``input[i]``)."""
    messages: list[ChatMessage] = []
    calls: set[str] = set()
    for index, item in enumerate(items):
        where = f"input[{index - first_own}]" if index >= first_own else "previous_response_id"
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = MessageToolCall(
                id=item.call_id, function=CalledFunction(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant" or len(last.tool_calls or []) >= MAX_TOOLS:
                last = ChatMessage(role="assistant", content="")
                messages.append(last)
            last.tool_calls = [*(last.tool_calls or []), call]
            calls.add(item.call_id)
        else:
            if item.call_id not in calls:
                raise InvalidRequestError(
                    f"{where}.call_id: no function_call before it has call_id "
                    f"{item.call_id[:64]!r}",
                    f"{where}.call_id",
                )
            messages.append(
                ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
            )
    return messages


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputBuilder:
    """A response's output items from its completion's text as it streams, and the events
    each piece of text makes (without their sequence numbers). ``call_format``: how tool calls
    are read out of the text (None: the text is all message)."""

    call_format: str | None = None
    items: list[dict[str, Any]] = field(default_factory=list)
    _reader: CallReader | None = None
    _message: int | None = None  # output index of the message item, once it has text
    _text: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.call_format is not None:
            self._reader = CallReader(self.call_format)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The events of ``text`` more of the completion."""
        if self._reader is None:
            return self._show(text)
        shown, calls = self._reader.feed(text)
        return self._show(shown) + [event for call in calls for event in self._call(call)]

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """The closing events once the completion ends (``incomplete``: it stopped at
        ``max_output_tokens``): what the reader held back, then the message's done events
        (an output with no items at all is an empty message)."""
        events = []
        if self._reader is not None:
            rest, calls = self._reader.finish()
            events += self._show(rest) + [event for call in calls for event in self._call(call)]
        if self._message is None and not self.items:
            events += self._open_message()
        if self._message is not None:
            events += self._close_message(incomplete)
        return events

    @property
    def text(self) -> str:
        """The message's text so far."""
        return "".join(self._text)

    def _show(self, text: str) -> list[dict[str, Any]]:
        if self._message is None:
            text = text.lstrip()  # (whitespace before any text, as chat's content is stripped)
            if not text:
                return []
        events = self._open_message() if self._message is None else []
        self._text.append(text)
        assert self._message is not None
        item = self.items[self._message]
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": item["id"],
                "output_index": self._message,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        )
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = len(self.items)
        item = {
            "type": "message",
            "id": new_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.items.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            {
                "type": "response.output_item.added",
                "output_index": self._message,
                "item": _copy(item),
            },
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": self._message,
                "content_index": 0,
                "part": part,
            },
        ]

    def _close_message(self, incomplete: bool) -> list[dict[str, Any]]:
        assert self._message is not None
        index, item = self._message, self.items[self._message]
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        item["content"] = [part]
        item["status"] = "incomplete" if incomplete else "completed"
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            {"type": "response.output_text.done", **where, "text": self.text, "logprobs": []},
            {"type": "response.content_part.done", **where, "part": dict(part)},
            {"type": "response.output_item.done", "output_index": index, "item": _copy(item)},
        ]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self.items)
        item = {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        added = _copy(item)
        item.update(arguments=call.arguments, status="completed")
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        return [
            {"type": "response.output_item.added", "output_index": index, "item": added},
            {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments},
            {
                "type": "response.function_call_arguments.done",
                **where,
                "arguments": call.arguments,
                "name": call.name,
            },
            {"type": "response.output_item.done", "output_index": index, "item": _copy(item)},
        ]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {key: list(value) if isinstance(value, list) else value for key, value in item.items()}


def response_body(
    rid: str,
    created: int,
    model: str,
    request: ResponsesRequest,
    items: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A response object: ``status`` ``in_progress`` (no items, no usage yet),
    ``completed`` or ``incomplete`` (stopped at ``max_output_tokens``)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "model": model,
        "output": [_copy(item) for item in items],
        "usage": usage,
        **request.echo(),
    }


def response_usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def as_input(items: list[dict[str, Any]]) -> Iterator[MessageItem | FunctionCallItem]:
    """A response's output items as input items of the conversation that continues it."""
    for item in items:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            yield MessageItem(role="assistant", content=text)
        else:
            yield FunctionCallItem(
                type="function_call",
                call_id=item["call_id"],
                name=item["name"],
                arguments=item["arguments"],
            )


@dataclass
class _Stored:
    body: dict[str, Any]
    conversation: list[Any]  # its input items (its predecessors' first) and output items


class ResponseStore:
    """The latest ``capacity`` responses (0: none kept), the oldest dropped first; safe to
    use from several threads."""

    def __init__(self, capacity: int = DEFAULT_STORE) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity!r}")
        self.capacity = capacity
        self._kept: OrderedDict[str, _Stored] = OrderedDict()
        self._lock = threading.Lock()

    def history(self, response_id: str | None) -> list[Any]:
        """The conversation a request continuing ``response_id`` comes after (none without
        one); raises ``InvalidRequestError`` naming ``previous_response_id`` where the store is
        off or does not hold it."""
        if response_id is None:
            return []
        if self.capacity == 0:
            raise InvalidRequestError(
                "previous_response_id needs the response store, which is off on this server "
                "(serve --max-stored-responses N)",
                "previous_response_id",
            )
        with self._lock:
            stored = self._kept.get(response_id)
        if stored is None:
            raise InvalidRequestError(
                f"previous_response_id: no stored response has id {response_id[:80]!r} (the "
                f"store keeps the latest {self.capacity})",
                "previous_response_id",
            )
        return list(stored.conversation)

    def put(self, body: dict[str, Any], conversation: list[Any]) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._kept[body["id"]] = _Stored(body, conversation)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            stored = self._kept.get(response_id)
        return None if stored is None else stored.body

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._kept.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
