"""Structured outputs and tool calls over HTTP (tiny model): replies that parse and validate,
tool calls as OpenAI sends them (whole and streamed), and every bad schema, grammar or tool a
400 naming the field, with the server serving on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from specbatch.engine.llm_engine import LLMEngine
from tests.helpers import write_tiny_model
from tests.server.conftest import RunningServer, tiny_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": SCHEMA,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ARGUMENTS = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}  # type: ignore[index]
USER = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for tool descriptions (its tokenizer spends ~1 token a byte)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=2048)


def long_engine(model_dir: Path) -> LLMEngine:
    return tiny_engine(model_dir, max_model_len=2048, num_kv_blocks=1024)


@pytest.fixture(scope="module")
def server(long_tiny_dir: Path) -> Iterator[RunningServer]:
    running = RunningServer(long_engine(long_tiny_dir))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def post(
    server: RunningServer, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 300, "temperature": 0, **extra}


def test_response_format_json_schema(server: RunningServer) -> None:
    for temperature, seed in ((0, None), (1.0, 4), (1.0, 5)):
        reply = post(
            server,
            chat(
                temperature=temperature,
                seed=seed,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True},
                },
            ),
        )
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_json_object_regex_choice_on_both_endpoints(server: RunningServer) -> None:
    reply = post(server, chat(response_format={"type": "json_object"}, max_tokens=200))
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["message"]["content"]
    if reply.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    reply = post(
        server,
        {"prompt": "0123", "max_tokens": 20, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
        "/v1/completions",
    )
    assert reply.status_code == 200, reply.text
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", reply.json()["choices"][0]["text"])
    reply = post(server, chat(structured_outputs={"choice": ["yes", "no"]}, n=3, temperature=1.0))
    assert reply.status_code == 200, reply.text
    assert {c["message"]["content"] for c in reply.json()["choices"]} <= {"yes", "no"}


def _calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for call in message["tool_calls"]:
        assert call["type"] == "function"
        assert call["id"].startswith("call_")
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, ARGUMENTS[call["function"]["name"]])
        calls.append((call["function"]["name"], arguments))
    return calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_required_and_named_give_valid_calls(
    server: RunningServer, temperature: float
) -> None:
    for choice, names in (
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ):
        reply = post(
            server,
            chat(
                tools=[WEATHER, TIME],
                tool_choice=choice,
                temperature=temperature,
                seed=1,
                parallel_tool_calls=False,  # a random model would add calls to max_tokens
            ),
        )
        assert reply.status_code == 200, reply.text
        out = reply.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        calls = _calls(out["message"])
        assert calls
        assert {name for name, _ in calls} <= names
        if choice != "required":
            assert len(calls) == 1


def test_parallel_tool_calls_false_makes_one_call(server: RunningServer) -> None:
    for seed in range(4):
        reply = post(
            server,
            chat(
                tools=[WEATHER, TIME],
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=1.0,
                seed=seed,
            ),
        )
        assert len(_calls(reply.json()["choices"][0]["message"])) == 1


def test_streamed_tool_calls_equal_the_whole_reply(client: OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "messages": USER,
        "max_tokens": 120,
        "temperature": 0,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.tool_calls
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                assert delta.function is not None
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]


def test_auto_reads_calls_the_model_writes_and_leaves_text_alone(server: RunningServer) -> None:
    """``auto`` leaves the model free: its text is the reply, or calls where it writes a
    block. A grammar that makes it write a block (structured_outputs still applies under
    ``auto``) shows the reading; a block that does not parse stays text."""
    reply = post(server, chat(tools=[WEATHER], max_tokens=12))
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message.get("tool_calls") is None
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
    for text, calls in (
        (f"Sure. <tool_call>[{call}]</tool_call>", [("get_weather", {"city": "Oslo", "days": 2})]),
        ("Sure. <tool_call>[{oops]</tool_call>", []),
    ):
        grammar = f"start: {json.dumps(text)}"
        reply = post(
            server,
            chat(tools=[WEATHER], structured_outputs={"grammar": grammar}, max_tokens=400),
        )
        assert reply.status_code == 200, reply.text
        out = reply.json()["choices"][0]
        if calls:
            assert out["finish_reason"] == "tool_calls"
            assert out["message"]["content"] == "Sure."
            assert _calls(out["message"]) == calls
        else:
            assert out["finish_reason"] == "stop"
            assert out["message"]["content"] == text
            assert out["message"].get("tool_calls") is None


def test_multi_turn_with_tool_results(server: RunningServer) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
            "refusal": None,  # echoed back from an earlier reply: ignored
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    reply = post(server, {"messages": messages, "tools": [TIME], "max_tokens": 8})
    assert reply.status_code == 200, reply.text


HOSTILE: list[tuple[dict[str, Any], str]] = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 5}},
            }
        },
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "x" * 70_000}}, "structured_outputs.grammar"),
    (
        {"structured_outputs": {"json": {"$ref": "#/d/a", "d": {"a": {"$ref": "#/d/a"}}}}},
        "structured_outputs.json",
    ),
    (
        {"structured_outputs": {"json": {"type": "integer", "minimum": 10**40}}},
        "structured_outputs.json",
    ),
    ({"structured_outputs": {"json": {"type": "string", "minLength": 5000}}}, "max_tokens"),
    (
        {"structured_outputs": {"regex": "a{100000}"}, "max_completion_tokens": 50},
        "max_completion_tokens",
    ),
    ({"structured_outputs": {"json": {"type": "object"}}, "ignore_eos": True}, "ignore_eos"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        {"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
]


@pytest.mark.parametrize(("extra", "param"), HOSTILE, ids=[p for _, p in HOSTILE])
def test_bad_constraints_are_400s_naming_the_field(
    server: RunningServer, extra: dict[str, Any], param: str
) -> None:
    body = {**chat(), **extra}
    if "max_completion_tokens" in extra:
        body.pop("max_tokens")
    reply = post(server, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert param.split(".")[0] in reply.json()["error"]["message"]
    # and the server serves on, its cache whole
    assert post(server, chat(max_tokens=4)).status_code == 200
    engine = server.engine
    assert httpx.get(server.url + "/health").status_code == 200
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_batch_file_takes_tools_and_response_format(long_tiny_dir: Path, tmp_path: Path) -> None:
    from specbatch.batch.job import BatchJob

    lines = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False),
        },
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": SCHEMA},
                }
            ),
        },
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat(structured_outputs={"regex": "(abc"}),
        },
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    target = tmp_path / "out.jsonl"
    job = BatchJob(long_engine(long_tiny_dir), "tiny", progress=False)
    job.run(source, target)
    results = {
        r["custom_id"]: r["response"] for r in map(json.loads, target.read_text().splitlines())
    }
    assert results["a"]["status_code"] == 200
    assert results["a"]["body"]["choices"][0]["finish_reason"] == "tool_calls"
    _calls(results["a"]["body"]["choices"][0]["message"])
    assert results["b"]["status_code"] == 200
    jsonschema.validate(
        json.loads(results["b"]["body"]["choices"][0]["message"]["content"]), SCHEMA
    )
    assert results["c"]["status_code"] == 400
    assert results["c"]["body"]["error"]["param"] == "structured_outputs.regex"


def _failing_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constraints whose grammar mentions ``zzz`` fail at their first committed token, as a
    backend limit hit mid-generation does (issue 58: a lexer's "too many expressions")."""
    from specbatch.structured import constraint

    real = constraint.Constraint.commit

    def commit(self: constraint.Constraint, tokens: Any) -> None:
        real(self, tokens)
        if self.error is None and "zzz" in str(self.grammar.compiled):
            self._fail("lexer error: too many expressions constructed")

    monkeypatch.setattr(constraint.Constraint, "commit", commit)


FAILING = [
    ({"structured_outputs": {"regex": "zzz[a-z]*"}}, "structured_outputs.regex"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": {"type": "object", "required": ["zzz"]}},
            }
        },
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("extra", "param"), FAILING, ids=[p for _, p in FAILING])
def test_a_constraint_failing_while_generating_is_a_4xx_naming_it(
    server: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
    extra: dict[str, Any],
    param: str,
    stream: bool,
) -> None:
    _failing_commits(monkeypatch)
    reply = post(server, chat(stream=stream, **extra))
    if stream:
        assert reply.status_code == 200  # (the headers went before the constraint failed)
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line[6:7] == "{"]
        error = events[-1]["error"]
        assert reply.text.rstrip().endswith("data: [DONE]")
    else:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
    assert error["param"] == param
    assert error["code"] == "constraint_failed"
    assert error["type"] == "invalid_request_error"
    assert "too many expressions" in error["message"]
    assert error["message"].startswith(param)
    assert post(server, chat(max_tokens=4)).status_code == 200
    engine = server.engine
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_a_batch_line_whose_constraint_fails_is_a_400(
    long_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specbatch.batch.job import BatchJob

    _failing_commits(monkeypatch)
    bodies = {"failing": chat(**FAILING[1][0]), "plain": chat(max_tokens=4)}
    lines = [
        {"custom_id": key, "method": "POST", "url": "/v1/chat/completions", "body": body}
        for key, body in bodies.items()
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = BatchJob(long_engine(long_tiny_dir), "tiny", progress=False).run(source, target)
    results = {
        r["custom_id"]: r["response"] for r in map(json.loads, target.read_text().splitlines())
    }
    assert results["failing"]["status_code"] == 400
    assert results["failing"]["body"]["error"]["param"] == FAILING[1][1]
    assert results["failing"]["body"]["error"]["code"] == "constraint_failed"
    assert results["plain"]["status_code"] == 200
    assert summary.failed == 1
