"""Hypothesis-generated hostile bodies against the server: wrong types, huge, negative and
non-finite numbers, huge integers, odd unicode (lone surrogates included), empty and nested
lists, unknown fields. Only 2xx and 4xx may come back, every 4xx an OpenAI error object, every
stream ends with ``[DONE]`` and no server error; afterwards a plain request is answered and no
request or cache block is left behind."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server.conftest import RunningServer, tiny_engine

NASTY_NUMBERS = [
    0,
    -1,
    1,
    2**31,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    2**64,
    10**100,
    1e39,
    -1e39,
    1e308,
    5e-324,
    float("inf"),
    float("-inf"),
    float("nan"),
    0.5,
    -0.0,
]
NASTY_TEXT = ["", "a\ud800", "\udfff\ud800", "\x00", "🙂" * 40, "\u202e\u0301", "<|im_start|>", " "]

# any code point, lone surrogates included (st.text() leaves them out by default)
any_text = st.text(st.characters(exclude_categories=()), max_size=12)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(NASTY_NUMBERS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(NASTY_TEXT),
    any_text,
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
token_lists = st.lists(st.integers(min_value=-5, max_value=400), max_size=6)

COMMON = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "priority",
    "model",
    "user",
]
COMPLETION_FIELDS = [*COMMON, "prompt", "logprobs", "echo", "suffix", "best_of"]
CHAT_FIELDS = [
    *COMMON,
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "add_generation_prompt",
    "chat_template_kwargs",
]


def field_values(name: str) -> st.SearchStrategy[Any]:
    """Mostly hostile values, sometimes plausible ones so that deeper checks are reached."""
    plausible: dict[str, st.SearchStrategy[Any]] = {
        "prompt": st.one_of(st.text(max_size=30), token_lists, st.lists(token_lists, max_size=3)),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": values}
            ),
            max_size=3,
        ),
        "max_tokens": st.integers(min_value=-2, max_value=6),
        "max_completion_tokens": st.integers(min_value=-2, max_value=6),
        "logit_bias": st.dictionaries(
            st.sampled_from(["5", "299", "300", "-1", "x", "9223372036854775808", "1e3"]),
            values,
            max_size=3,
        ),
        "stop_token_ids": st.lists(st.sampled_from(NASTY_NUMBERS + [5, 299, 300]), max_size=3),
        "n": st.integers(min_value=-1, max_value=20),
        "stream": st.booleans(),
        "model": st.one_of(st.just("tiny"), any_text),
        "chat_template_kwargs": st.dictionaries(
            st.one_of(
                st.sampled_from(["self", "messages", "add_generation_prompt", "tools", "x"]),
                any_text,
            ),
            values,
            max_size=3,
        ),
    }
    if name in plausible:
        return st.one_of(plausible[name], values)
    return values


def bodies(fields: list[str], required: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid minimal body with up to six fields replaced or added, sometimes an unknown one."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": 4, **required}
        for name in draw(st.lists(st.sampled_from(fields), max_size=6, unique=True)):
            body[name] = draw(field_values(name))
        if draw(st.booleans()):
            body[draw(any_text)] = draw(values)
        return body

    return build()


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    engine = tiny_engine(tiny_model_dir, max_model_len=64, num_kv_blocks=256, max_num_seqs=16)
    running = RunningServer(engine, max_body_bytes=1 << 20)
    yield running
    running.stop()


def post(server: RunningServer, path: str, body: Any) -> None:
    """Send one body (a lone surrogate travels as its JSON escape) and check the answer."""
    payload = json.dumps(body, allow_nan=True).encode()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        headers = {"content-type": "application/json"}
        with client.stream("POST", path, content=payload, headers=headers) as response:
            text = "".join(response.iter_text())
            status = response.status_code
            kind = response.headers.get("content-type", "")
    event(f"HTTP {status}")
    assert status < 500, (status, body, text[:500])
    if status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, text
        assert isinstance(error["message"], str)
        assert error["message"]
    elif kind.startswith("text/event-stream"):
        events = [line for line in text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", text[-300:]
        for line in events[:-1]:
            assert "error" not in json.loads(line[6:]), line
    else:
        assert json.loads(text)["choices"]


# SPECBATCH_FUZZ_EXAMPLES raises the count for a long run (the default keeps CI fast).
EXAMPLES = int(os.environ.get("SPECBATCH_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(body=bodies(COMPLETION_FIELDS, {"prompt": "fuzz"}))
def test_fuzzed_completions(fuzz_server: RunningServer, body: dict[str, Any]) -> None:
    post(fuzz_server, "/v1/completions", body)


@FUZZ
@given(body=bodies(CHAT_FIELDS, {"messages": [{"role": "user", "content": "fuzz"}]}))
def test_fuzzed_chat(fuzz_server: RunningServer, body: dict[str, Any]) -> None:
    post(fuzz_server, "/v1/chat/completions", body)


@settings(
    max_examples=max(60, EXAMPLES // 3),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=values)
def test_fuzzed_whole_bodies(fuzz_server: RunningServer, body: Any) -> None:
    post(fuzz_server, "/v1/completions", body)


def test_the_server_is_whole_after_fuzzing(fuzz_server: RunningServer) -> None:
    """Runs after the fuzzers (file order): nothing left running, every block back."""
    engine = fuzz_server.engine
    body = {"prompt": "still here", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    response = httpx.post(f"{fuzz_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
    engine.cache.pool.check_consistency()
    assert engine.stats.num_failed_steps == 0
    assert fuzz_server.async_engine.is_running
    assert httpx.get(f"{fuzz_server.url}/health").json() == {"status": "ok"}
