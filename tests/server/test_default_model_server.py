"""The openai client against a server on the real default model (SmolLM2-135M)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

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
