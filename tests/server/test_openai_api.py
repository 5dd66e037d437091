"""The official openai client against the server (tiny model): the API's behaviour end to end."""

from __future__ import annotations

import pytest
from openai import OpenAI

from specbatch import SamplingParams
from tests.server.conftest import RunningServer


@pytest.fixture(scope="module")
def client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_and_health(client: OpenAI, server: RunningServer) -> None:
    import httpx

    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_streaming_equals_non_streaming(client: OpenAI) -> None:
    kwargs = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 20, "temperature": 0}
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None
    assert full.usage.completion_tokens == 20
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streaming_equals_non_streaming(client: OpenAI) -> None:
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 24,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_n_choices_seeds_and_stop(client: OpenAI) -> None:
    many = client.completions.create(
        model="tiny", prompt=["abc", "def"], n=3, max_tokens=8, temperature=1.0, seed=5
    )
    assert sorted(c.index for c in many.choices) == list(range(6))
    again = client.completions.create(
        model="tiny", prompt=["abc", "def"], n=3, max_tokens=8, temperature=1.0, seed=5
    )
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    free = client.completions.create(model="tiny", prompt="abc", max_tokens=30, temperature=0)
    text = free.choices[0].text
    # two printable characters from the middle (random weights also emit invalid UTF-8)
    start = next(
        i
        for i in range(4, len(text) - 1)
        if text[i : i + 2].isprintable() and "\ufffd" not in text[i : i + 2]
    )
    stop = text[start : start + 2]
    cut = client.completions.create(
        model="tiny", prompt="abc", max_tokens=30, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(client: OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="abc", max_tokens=5, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    # keyed by token text: distinct ids decoding alike (invalid UTF-8 pieces) share a key
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert all(
        max(top.values()) == pytest.approx(chosen)
        for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(item.top_logprobs) == 2 for item in content)


def test_usage_in_stream(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


def test_matches_the_engine_directly(server: RunningServer, client: OpenAI) -> None:
    from specbatch.engine.llm import LLM

    llm = LLM(str(server.engine.model_path), num_kv_blocks=64, block_size=8, max_model_len=256)
    expected = (
        llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[
            0
        ]
        .outputs[0]
        .text
    )
    got = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=12, temperature=0
    )
    assert got.choices[0].text == expected
