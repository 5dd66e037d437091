"""Tool calls read out of text: streamed in any chunks, the reader gives what reading the whole
text gives; the request model's constraint and template inputs for each tool_choice."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.errors import InvalidRequestError
from specbatch.server.protocol import ChatCompletionRequest
from specbatch.server.tools import CLOSE, OPEN, TAGS, WHOLE, CallReader, read_calls

CALL = '{"name": "f", "arguments": {"a": 1}}'
TEXTS = [
    "plain text, no calls",
    f"Sure. {OPEN}[{CALL}]{CLOSE}",
    f"{OPEN}{CALL}{CLOSE} and {OPEN}[{CALL}, {CALL}]{CLOSE} done",
    f"broken {OPEN}[{{oops]{CLOSE} stays text",
    f"half a tag <tool_ and {OPEN}[{CALL}]",  # an unclosed block whose JSON is whole
    f"{OPEN}[{CALL}",  # cut by max_tokens: text
    "<<tool_call>[" + CALL + "]" + CLOSE,
]


@settings(max_examples=200, deadline=None)
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_reading_equals_whole_reading(text: str, cuts: list[int]) -> None:
    whole_content, whole_calls = read_calls(text)
    reader = CallReader(TAGS)
    shown, calls = [], []
    edges = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for start, end in itertools.pairwise(edges):
        content, made = reader.feed(text[start:end])
        shown.append(content)
        calls += made
    rest, made = reader.finish()
    shown.append(rest)
    calls += made
    assert ("".join(shown).strip() or None) == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_reading_whole_replies() -> None:
    content, calls = read_calls(f"[{CALL}, {CALL}]", WHOLE)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})] * 2
    content, calls = read_calls('{"answer": 3}', WHOLE)  # an answer, not calls
    assert content == '{"answer": 3}'
    assert calls == []
    assert read_calls(f"{OPEN}[{CALL}]{CLOSE}")[1][0].id.startswith("call_")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def request(**extra: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **extra}
    )


def test_constraints_per_tool_choice() -> None:
    assert request().constraint() is None  # auto: the model is free
    assert request().call_format() == TAGS
    assert request(tool_choice="none").call_format() is None
    required = request(tool_choice="required").constraint()
    assert required is not None
    assert request(tool_choice="required").call_format() == WHOLE
    schema = required.json
    assert isinstance(schema, dict)
    jsonschema.validate([{"name": "weather", "arguments": {"city": "Oslo"}}], schema)
    jsonschema.validate(
        [{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}], schema
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "weather", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    one = request(tool_choice="required", parallel_tool_calls=False).constraint()
    assert one is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "arguments": {}}] * 2, one.json)  # type: ignore[arg-type]
    named = request(tool_choice={"type": "function", "function": {"name": "now"}}).constraint()
    assert named is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "weather", "arguments": {"city": "x"}}], named.json)  # type: ignore[arg-type]
    answer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    either = request(
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}
    ).constraint()
    assert either is not None
    jsonschema.validate({"n": 1}, either.json)  # type: ignore[arg-type]
    jsonschema.validate([{"name": "now", "arguments": {}}], either.json)  # type: ignore[arg-type]


def test_templates_that_know_tools_get_them_and_others_get_a_description() -> None:
    body = request(
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        ]
    )
    _, options = body.template_options(template_knows_tools=True)
    assert [t["function"]["name"] for t in options["tools"]] == ["weather", "now"]
    knowing = body.conversation(template_knows_tools=True)
    assert knowing[1]["tool_calls"][0]["function"] == {"name": "now", "arguments": {}}
    assert knowing[2]["tool_call_id"] == "c1"
    plain = body.conversation(template_knows_tools=False)
    assert plain[0]["role"] == "system"
    assert "weather" in plain[0]["content"]
    assert plain[2]["content"] == f'{OPEN}[{{"name": "now", "arguments": {{}}}}]{CLOSE}'
    assert "tools" not in body.template_options(template_knows_tools=False)[1]
    assert request(tool_choice="none").conversation()[0]["role"] == "user"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS + TOOLS}, "tools"),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_tool_choice_mistakes(extra: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        request(**extra).tool_mode()
    assert refused.value.param == param
