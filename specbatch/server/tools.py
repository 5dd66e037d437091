"""Tool calls on chat completions: the tools described to the model, the JSON schema that
makes a ``required`` or named call valid, and the calls read back out of the model's text.

The model is told to write calls in the Hermes / SmolLM2 function-calling format, one block
holding a JSON list of calls (a single object is read as a list of one)::

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

A chat template that renders ``tools`` itself gets them as a template variable; for one that
does not (SmolLM2's), the tools and the format are described in the system message. With
``tool_choice`` ``auto`` the model chooses, and the blocks it writes are read as calls (one
that does not parse stays in the reply's content: ``TAGS``). With ``required`` or a named
function the whole reply is constrained to the JSON list of calls, each matching its tool's
parameter schema (a plain JSON-schema constraint, so every backend takes it), and is read
whole (``WHOLE``): the arguments always parse and validate.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TAGS, WHOLE = "tags", "whole"  # how a reply's calls are read: blocks in text, or all of it


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def as_message(self) -> dict[str, Any]:
        """The call as an item of ``message.tool_calls``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def as_delta(self, index: int) -> dict[str, Any]:
        """The call, whole, as an item of a streamed ``delta.tool_calls``."""
        return {"index": index, **self.as_message()}


def describe_tools(functions: Sequence[Mapping[str, Any]]) -> str:
    """The system text telling a model whose template knows nothing of tools what it may call
    and how (``functions``: each tool's ``function`` object)."""
    listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return (
        f"You may call these tools:\n<tools>\n{listed}\n</tools>\n"
        f'To call tools, reply with {OPEN}[{{"name": "tool_name", "arguments": {{...}}}}]{CLOSE}'
        " (a JSON list of calls whose arguments match the tool's parameters); otherwise "
        "answer in plain text."
    )


def calls_schema(
    functions: Sequence[Mapping[str, Any]], parallel: bool, only: str | None = None
) -> dict[str, Any]:
    """The JSON schema of a block's list of calls: each one names a function (``only``, when
    given) and carries arguments valid for that function's parameters."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
        if only is None or f["name"] == only
    ]
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel or only is not None:
        schema["maxItems"] = 1
    return schema


def template_knows_tools(template: str | None) -> bool:
    """Whether a chat template renders the ``tools`` variable itself."""
    return template is not None and "tools" in template


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_block(body: str) -> list[ToolCall] | None:
    """The calls of one block's JSON text, or None when it is not a list of calls (each an
    object with a string ``name`` and object ``arguments``; OpenAI's ``parameters`` too)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    calls = value if isinstance(value, list) else [value]
    parsed = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        parsed.append(ToolCall(_call_id(), call["name"], json.dumps(arguments, ensure_ascii=False)))
    return parsed or None


class CallReader:
    """Reads one completion's text as it streams: the text to show as content, and the calls.
    ``TAGS``: each block of calls once it is closed (a block that does not parse is shown as
    content). ``WHOLE``: the completion is a list of calls (or, failing that, content),
    known at its end."""

    def __init__(self, kind: str = TAGS) -> None:
        self.kind = kind
        self._pending = ""  # text not yet shown: a possible tag start, an open block, or all
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content to show, calls completed)`` after ``text`` more of the completion."""
        self._pending += text
        if self.kind == WHOLE:
            return "", []
        shown, calls = [], []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _partial_tag(self._pending)
                shown.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            end = self._pending.find(CLOSE, start + len(OPEN))
            if end < 0:
                shown.append(self._pending[:start])
                self._pending = self._pending[start:]
                break
            block = parse_block(self._pending[start + len(OPEN) : end])
            if block is None:
                shown.append(self._pending[: end + len(CLOSE)])
            else:
                shown.append(self._pending[:start])
                calls += block
            self._pending = self._pending[end + len(CLOSE) :]
        self.calls += calls
        return "".join(shown), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left when the completion ends: an unclosed block whose JSON is complete
        (the stop string ate its tag) is read as calls, anything else is content."""
        rest, self._pending = self._pending, ""
        if self.kind == WHOLE or rest.startswith(OPEN):
            block = parse_block(rest if self.kind == WHOLE else rest[len(OPEN) :])
            if block is not None:
                self.calls += block
                return "", block
        return rest, []


def _partial_tag(text: str) -> int:
    """The length of the longest end of ``text`` that could start an ``OPEN`` tag."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def read_calls(text: str, kind: str = TAGS) -> tuple[str | None, list[ToolCall]]:
    """A whole completion's ``(content, calls)``: content is None when only calls remain."""
    reader = CallReader(kind)
    shown, _ = reader.feed(text)
    rest, _ = reader.finish()
    content = (shown + rest).strip()
    return (content or None), reader.calls
