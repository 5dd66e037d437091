"""The openai client against a server on the real default model (SmolLM2-135M)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from specbatch.config import EngineConfig
from specbatch.engine.llm_engine import LLMEngine
from tests.server.conftest import RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    engine = LLMEngine(
        EngineConfig(
            max_model_len=1024,
            num_kv_blocks=512,
            max_num_seqs=8,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        )
    )
    server = RunningServer(engine, served_model_name="SmolLM2-135M-Instruct")
    yield OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    server.stop()


def test_chat_answers_and_streams_the_same_text(client: OpenAI) -> None:
    kwargs = {
        "model": "SmolLM2-135M-Instruct",
        "temperature": 0,
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content or ""
    assert "Paris" in text
    assert full.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )
    assert streamed == text


def test_completion_n_stop_and_seed(client: OpenAI) -> None:
    base = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 24}
    sampled = client.completions.create(n=2, temperature=0.9, seed=3, **base)
    again = client.completions.create(n=2, temperature=0.9, seed=3, **base)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    greedy = client.completions.create(temperature=0, **base).choices[0].text
    words = greedy.split()
    stop = words[3]
    cut = client.completions.create(temperature=0, stop=stop, **base).choices[0]
    assert cut.text == greedy[: greedy.find(stop)]
    assert cut.finish_reason == "stop"


class Capital(BaseModel):
    country: str = Field(max_length=24)
    capital: str = Field(max_length=24)


def test_parse_with_a_pydantic_response_format(client: OpenAI) -> None:
    """The openai client's ``parse``: a json_schema response_format (strict) from a pydantic
    model, the reply parsed back into it."""
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    completion = parse(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France? Reply in JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=60,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Capital)
    assert "Paris" in parsed.capital


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 40}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_tool_calls_required_and_named(client: OpenAI, tool_choice: str, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": (
            "required"
            if tool_choice == "required"
            else {"type": "function", "function": {"name": "get_weather"}}
        ),
        "temperature": 0,
        "max_tokens": 120,
    }
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        pieces: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                for delta in c.delta.tool_calls or []:
                    assert delta.function is not None
                    entry = pieces.setdefault(delta.index, ["", ""])
                    entry[0] += delta.function.name or ""
                    entry[1] += delta.function.arguments or ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls"
        calls = [(name, arguments) for name, arguments in pieces.values()]
    assert calls
    for name, arguments in calls:
        assert name in ("get_weather", "get_time")
        if tool_choice == "named":
            assert name == "get_weather"
        parameters = (WEATHER_TOOL if name == "get_weather" else TIME_TOOL)["function"]
        jsonschema.validate(json.loads(arguments), parameters["parameters"])
