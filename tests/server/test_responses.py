"""``/v1/responses`` through the official openai client (tiny model): each answer against the
chat completion of the same conversation on the same server (the reference: the same tokens,
greedy), streaming against the whole reply, JSON schemas validated, a function tool round trip,
``previous_response_id``, the store, and hostile bodies answered with a 4xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from specbatch.errors import InvalidRequestError
from specbatch.server.responses import MessageItem, ResponseStore
from tests.helpers import write_tiny_model
from tests.server.conftest import RunningServer, tiny_engine
from tests.server.test_structured_server import SCHEMA

WEATHER = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for tool descriptions."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(long_dir: Path) -> Iterator[RunningServer]:
    running = RunningServer(tiny_engine(long_dir, max_model_len=2048, num_kv_blocks=1024))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(server: RunningServer, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"messages": messages, "temperature": 0, **extra}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def post(server: RunningServer, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)


def test_text_and_instructions_are_the_chat_completions_answer(
    server: RunningServer, client: OpenAI
) -> None:
    reply = client.responses.create(
        model="tiny",
        input="The quick brown fox",
        instructions="Answer briefly.",
        max_output_tokens=24,
        temperature=0,
    )
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "The quick brown fox"},
    ]
    reference = chat(server, messages, max_tokens=24)
    assert reply.object == "response"
    assert reply.id.startswith("resp_")
    assert reply.output_text == reference["choices"][0]["message"]["content"]
    assert reply.usage is not None
    assert reply.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert reply.usage.output_tokens == reference["usage"]["completion_tokens"]
    finished = reference["choices"][0]["finish_reason"]
    assert reply.status == ("incomplete" if finished == "length" else "completed")
    assert [item.type for item in reply.output] == ["message"]
    assert reply.instructions == "Answer briefly."


def test_message_items_are_the_chat_messages(server: RunningServer, client: OpenAI) -> None:
    items: list[Any] = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "And then?"},
    ]
    reply = client.responses.create(model="tiny", input=items, max_output_tokens=16, temperature=0)
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And then?"},
    ]
    reference = chat(server, messages, max_tokens=16)
    assert reply.output_text == reference["choices"][0]["message"]["content"]
    assert reply.usage is not None
    assert reply.usage.input_tokens == reference["usage"]["prompt_tokens"]


def test_max_output_tokens_makes_it_incomplete(client: OpenAI) -> None:
    reply = client.responses.create(model="tiny", input="Count", max_output_tokens=3, temperature=0)
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None
    assert reply.usage.output_tokens == 3


def test_streaming_events_add_up_to_the_whole_reply(client: OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "input": "Tell me something",
        "max_output_tokens": 30,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1
    assert done[0].text == deltas == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text
    assert final.status == whole.status
    assert final.usage is not None
    assert whole.usage is not None
    # (the second run may find the first's prompt in the prefix cache: cached tokens differ)
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.id for e in item_done] == [item.id for item in final.output]


def test_a_json_schema_format_validates_and_parses(client: OpenAI) -> None:
    text = {"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0):
        reply = client.responses.create(
            model="tiny",
            input="Plan a trip",
            text=text,  # type: ignore[arg-type]
            max_output_tokens=300,
            temperature=temperature,
        )
        jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    loose = client.responses.create(
        model="tiny",
        input="Any object",
        text={"format": {"type": "json_object"}},
        max_output_tokens=300,
        temperature=0,
    )
    assert isinstance(json.loads(loose.output_text), dict)

    class Trip(BaseModel):
        city: str = Field(max_length=8)
        days: int = Field(ge=1, le=9)

    parsed = client.responses.parse(
        model="tiny", input="Plan a trip", text_format=Trip, max_output_tokens=300, temperature=0
    )
    assert isinstance(parsed.output_parsed, Trip)


def test_a_function_tool_round_trip(server: RunningServer, client: OpenAI) -> None:
    first = client.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    reference = chat(
        server,
        [{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[CHAT_WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
    )
    called = reference["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (called["name"], called["arguments"]) == (call.name, call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[result],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=20,
        temperature=0,
    )
    # the same conversation given whole, without the store, and as chat messages
    whole = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            result,
        ],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=20,
        temperature=0,
        store=False,
    )
    tool_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    as_chat = chat(
        server,
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
        ],
        tools=[CHAT_WEATHER],
        max_tokens=20,
    )
    assert second.usage is not None
    assert whole.usage is not None
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens == as_chat["usage"]["prompt_tokens"]
    assert second.output_text == whole.output_text


def test_streamed_function_calls_equal_the_whole_reply(client: OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "input": "Weather?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 300,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls
    assert deltas == "".join(c.arguments for c in calls)
    final = events[-1].response  # type: ignore[union-attr]
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in whole.output
    ]


def test_previous_response_id_continues_the_conversation(
    server: RunningServer, client: OpenAI
) -> None:
    first = client.responses.create(
        model="tiny", input="Hello there", max_output_tokens=12, temperature=0
    )
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input="Go on",
        instructions="New instructions.",
        max_output_tokens=12,
        temperature=0,
    )
    reference = chat(
        server,
        [
            {"role": "system", "content": "New instructions."},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Go on"},
        ],
        max_tokens=12,
    )
    assert second.output_text == reference["choices"][0]["message"]["content"]
    assert second.usage is not None
    assert second.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    deleted = httpx.delete(f"{server.url}/v1/responses/{first.id}").json()
    assert deleted == {"id": first.id, "object": "response", "deleted": True}
    assert httpx.get(f"{server.url}/v1/responses/{first.id}").status_code == 404
    gone = post(server, {"input": "x", "previous_response_id": first.id})
    assert gone.status_code == 400
    assert gone.json()["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{unstored.id}").status_code == 404


def test_the_store_keeps_the_latest_and_may_be_off() -> None:
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [MessageItem(role="user", content=str(i))])
    assert [store.get(f"r{i}") is not None for i in range(3)] == [False, True, True]
    assert store.history("r2")[0].content == "2"
    with pytest.raises(InvalidRequestError, match="no stored response") as missing:
        store.history("r0")
    assert missing.value.param == "previous_response_id"
    off = ResponseStore(0)
    off.put({"id": "r"}, [])
    assert len(off) == 0
    with pytest.raises(InvalidRequestError, match="store, which is off") as refused:
        off.history("r")
    assert refused.value.param == "previous_response_id"
    assert off.history(None) == []


RESPONSES = "/v1/responses"
HOSTILE: list[tuple[str, int, str | None]] = [
    ('{"input": "hi", "max_output_tokens": 100000000000000000000}', 400, "max_output_tokens"),
    ('{"input": "hi", "max_output_tokens": 0}', 400, "max_output_tokens"),
    ('{"input": "hi", "temperature": Infinity}', 400, "temperature"),
    ('{"input": "a\\ud800"}', 400, "input"),
    ('{"input": [{"role": "user", "content": "\\udfff"}]}', 400, "input"),
    ('{"input": []}', 400, "input"),
    ('{"input": [{"type": "image_generation_call", "id": "x"}]}', 400, "input"),
    ('{"input": [{"role": "user", "content": [{"type": "input_image"}]}]}', 400, None),
    ('{"input": [{"role": "tool", "content": "x"}]}', 400, None),
    ('{"input": [' + ",".join(['{"role": "user", "content": "x"}'] * 10000) + "]}", 400, "input"),
    ('{"input": ' + "[" * 5000 + "]" * 5000 + "}", 400, None),
    ('{"input": "hi", "reasoning": {"effort": "high"}}', 400, "reasoning"),
    ('{"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}', 400, None),
    (
        '{"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}',
        400,
        "input[0].call_id",
    ),
    ('{"input": "hi", "tool_choice": "required"}', 400, "tool_choice"),
    ('{"input": "hi", "previous_response_id": "resp_nope"}', 400, "previous_response_id"),
    ('{"input": "hi", "model": "other"}', 404, "model"),
    ('{"input": "hi", "priority": 3}', 400, "priority"),
    ('{"input": "' + "word " * 3000 + '"}', 400, "input"),
]


@pytest.mark.parametrize(("body", "status", "param"), HOSTILE)
def test_hostile_bodies_are_4xx_and_the_server_serves_on(
    server: RunningServer, body: str, status: int, param: str | None
) -> None:
    response = httpx.post(
        f"{server.url}{RESPONSES}",
        content=body.encode("utf-8", "surrogatepass"),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["message"]
    if param is not None:
        assert (error["param"] or "").startswith(param), error
    ok = post(server, {"input": "alive?", "max_output_tokens": 2})
    assert ok.status_code == 200, ok.text
    engine = server.engine
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_a_batch_file_answers_responses_as_the_server_does(
    server: RunningServer, long_dir: Path, tmp_path: Path
) -> None:
    from specbatch.batch.job import BatchJob

    bodies = {
        "text": {"input": "The quick brown fox", "max_output_tokens": 12, "temperature": 0},
        "tool": {
            "input": "Weather?",
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_output_tokens": 300,
            "temperature": 0,
        },
        "chained": {"input": "x", "previous_response_id": "resp_1"},
        "bad": {"input": []},
    }
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(
        "".join(
            json.dumps({"custom_id": k, "method": "POST", "url": "/v1/responses", "body": b}) + "\n"
            for k, b in bodies.items()
        )
    )
    engine = tiny_engine(long_dir, max_model_len=2048, num_kv_blocks=1024)
    BatchJob(engine, "tiny", progress=False).run(source, target)
    results = {
        r["custom_id"]: r["response"] for r in map(json.loads, target.read_text().splitlines())
    }
    for key in ("text", "tool"):
        assert results[key]["status_code"] == 200
        got = results[key]["body"]
        served = post(server, bodies[key]).json()
        assert got["object"] == "response"
        assert got["id"].startswith("resp_")
        assert [_content(i) for i in got["output"]] == [_content(i) for i in served["output"]]
        for count in ("input_tokens", "output_tokens"):  # (cached tokens may differ)
            assert got["usage"][count] == served["usage"][count]
    assert results["chained"]["status_code"] == 400
    assert results["chained"]["body"]["error"]["param"] == "previous_response_id"
    assert results["bad"]["status_code"] == 400
    assert results["bad"]["body"]["error"]["param"] == "input"


def _content(item: dict[str, Any]) -> Any:
    """An output item without its ids."""
    if item["type"] == "message":
        return ("message", item["status"], [part["text"] for part in item["content"]])
    return (item["type"], item["name"], item["arguments"])
