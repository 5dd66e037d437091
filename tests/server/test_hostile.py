"""Each body that once killed the engine, hung a request, stalled the server or gave a 500 is a
4xx naming its field now, and the server goes on answering."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import RunningServer, tiny_engine

WAIT = 60.0  # seconds: a guard against a hang, never a measure of speed


@pytest.fixture(scope="module")
def hostile_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    running = RunningServer(tiny_engine(tiny_model_dir), max_body_bytes=1 << 20)
    yield running
    running.stop()


def assert_alive(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        body = {"prompt": "alive?", "max_tokens": 3, "ignore_eos": True}
        ok = client.post("/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 3
    engine = server.engine
    deadline = time.monotonic() + WAIT
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
    assert engine.stats.num_failed_steps == 0


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param, error
    return dict(error)


COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]

# (path, raw JSON body, status, param) -- raw so that Infinity and lone surrogates go as sent
REPROS: list[tuple[str, str, int, str | None]] = [
    (COMPLETION, '{"prompt": "hi", "top_k": 9223372036854775808}', 400, "top_k"),
    (COMPLETION, '{"prompt": "hi", "logit_bias": {"9223372036854775808": 1}}', 400, "logit_bias"),
    (COMPLETION, '{"prompt": "hi", "logit_bias": {"-5": 1}}', 400, "logit_bias"),
    (COMPLETION, '{"prompt": "hi", "logit_bias": {"12": true}}', 400, "logit_bias.12"),
    (
        COMPLETION,
        '{"prompt": "hi", "stop_token_ids": [9223372036854775808]}',
        400,
        "stop_token_ids",
    ),
    (COMPLETION, '{"prompt": "hi", "stop_token_ids": [100000]}', 400, "stop_token_ids"),
    (COMPLETION, '{"prompt": "a\\ud800", "max_tokens": 2}', 400, "prompt"),
    (COMPLETION, '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', 400, "prompt"),
    (COMPLETION, '{"prompt": []}', 400, "prompt"),
    (COMPLETION, '{"prompt": [[]]}', 400, "prompt"),
    (COMPLETION, '{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    (COMPLETION, '{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (COMPLETION, '{"prompt": "hi", "temperature": 1e39}', 400, "temperature"),
    (COMPLETION, '{"prompt": "hi", "temperature": true}', 400, "temperature"),
    (COMPLETION, '{"prompt": "hi", "temperature": "0.5"}', 400, "temperature"),
    (COMPLETION, '{"prompt": "hi", "repetition_penalty": 1e39}', 400, "repetition_penalty"),
    (COMPLETION, '{"prompt": "hi", "repetition_penalty": -Infinity}', 400, "repetition_penalty"),
    (COMPLETION, '{"prompt": "hi", "max_tokens": 100000000000000000000}', 400, "max_tokens"),
    (COMPLETION, '{"prompt": "hi", "seed": 1e3}', 400, "seed"),
    (COMPLETION, '{"prompt": "hi", "priority": 5}', 400, "priority"),
    (COMPLETION, '{"prompt": "hi", "stop": ["' + "x" * 2000 + '"]}', 400, "stop"),
    (COMPLETION, '{"prompt": "hi", "model": "\\ud800"}', 404, "model"),
    (CHAT, '{"messages": []}', 400, "messages"),
    (CHAT, '{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400, "messages"),
    (
        CHAT,
        '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}}',
        400,
        "chat_template_kwargs",
    ),
    (
        CHAT,
        '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
        400,
        "max_completion_tokens",
    ),
    (
        CHAT,
        '{"messages": [{"role": "user", "content": "' + "word " * 2000 + '"}]}',
        400,
        "messages",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), REPROS)
def test_hostile_bodies_are_named_and_harmless(
    hostile_server: RunningServer, path: str, body: str, status: int, param: str | None
) -> None:
    response = httpx.post(
        f"{hostile_server.url}{path}",
        content=body.encode("utf-8", "surrogatepass"),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert_error(response, status, param)
    assert_alive(hostile_server)


def test_top_k_beyond_int64_minus_one_is_simply_everything(hostile_server: RunningServer) -> None:
    body = {"prompt": "hi", "top_k": 2**63 - 1, "max_tokens": 3, "seed": 1}
    response = httpx.post(f"{hostile_server.url}{COMPLETION}", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert_alive(hostile_server)


def test_template_variables_may_have_any_name(hostile_server: RunningServer) -> None:
    body = {"messages": HELLO, "max_tokens": 2, "chat_template_kwargs": {"self": 1, "x": [2]}}
    response = httpx.post(f"{hostile_server.url}{CHAT}", json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_chat_template_kwargs_may_turn_the_generation_prompt_off(
    hostile_server: RunningServer,
) -> None:
    body = {
        "messages": HELLO,
        "max_tokens": 2,
        "chat_template_kwargs": {"add_generation_prompt": False},
    }
    response = httpx.post(f"{hostile_server.url}{CHAT}", json=body, timeout=30)
    assert response.status_code == 200, response.text
    no_prompt = response.json()["usage"]["prompt_tokens"]
    body.pop("chat_template_kwargs")
    with_prompt = httpx.post(f"{hostile_server.url}{CHAT}", json=body, timeout=30).json()
    assert with_prompt["usage"]["prompt_tokens"] > no_prompt


def test_too_many_prompts_is_a_400_with_the_limit(tiny_model_dir: Path) -> None:
    server = RunningServer(tiny_engine(tiny_model_dir, num_kv_blocks=64), max_queued=8)
    try:
        body = {"prompt": [f"p{i}" for i in range(9)], "max_tokens": 1}
        error = assert_error(httpx.post(f"{server.url}{COMPLETION}", json=body), 400, "prompt")
        assert "at most 8" in error["message"]
        body = {"prompt": "p", "n": 9, "max_tokens": 1}
        assert_error(httpx.post(f"{server.url}{COMPLETION}", json=body), 400, "n")
        assert_alive(server)
    finally:
        server.stop()


def raw_request(server: RunningServer, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` (and ``body``) on a raw socket; the response, read until the server closes
    the connection (a refusal does at once) or sends nothing for ``WAIT`` seconds."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(head + body)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            pass
    return data


def test_oversized_bodies_are_refused_before_they_arrive(hostile_server: RunningServer) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 20000000\r\n\r\n"
    )
    # 12 of the 20 MB declared are ever sent: a server that waited for the body would never
    # answer (raw_request gives up, empty-handed, after WAIT seconds of silence)
    response = raw_request(hostile_server, head, b'{"prompt": "')
    assert response.startswith(b"HTTP/1.1 413")
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 65536
    # just past the 1 MiB limit, with no end: the server must answer before the body ends
    body = (b"%x\r\n" % len(piece) + piece + b"\r\n") * 17
    assert raw_request(hostile_server, chunked, body).startswith(b"HTTP/1.1 413")
    assert_alive(hostile_server)


def test_a_huge_prompt_does_not_stall_other_clients(
    hostile_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The huge prompt's tokenization waits until other clients were answered: were it on the
    event loop, nobody could be, and its wait would run out with the gate still shut."""
    prompt = "lorem ipsum " * 80_000  # ~1 MB of text for a 256-token context
    intake = hostile_server.engine.intake
    tokenize = intake.tokenize
    begun, answered = threading.Event(), threading.Event()
    opened: list[bool] = []

    def gated(text: str, param: str = "prompt") -> list[int]:
        if len(text) > 1000:  # the huge prompt's (assert_alive's goes through)
            begun.set()
            opened.append(answered.wait(timeout=WAIT))
        return tokenize(text, param)

    monkeypatch.setattr(intake, "tokenize", gated)
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        result["big"] = httpx.post(
            f"{hostile_server.url}{COMPLETION}",
            json={"prompt": prompt[: (1 << 20) - 100]},
            timeout=2 * WAIT,
        )

    thread = threading.Thread(target=send)
    thread.start()
    assert begun.wait(timeout=WAIT)
    for _ in range(3):
        response = httpx.get(f"{hostile_server.url}/health", timeout=2 * WAIT)
        assert response.status_code == 200
    answered.set()
    thread.join()
    assert opened == [True]
    assert_error(result["big"], 400, "prompt")


def test_api_key_guards_everything_but_health(tiny_model_dir: Path) -> None:
    server = RunningServer(tiny_engine(tiny_model_dir, num_kv_blocks=64), api_key="sekret")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for method, path in [
                ("POST", COMPLETION),
                ("POST", CHAT),
                ("GET", "/v1/models"),
                ("GET", "/metrics"),
                ("GET", "/docs"),
                ("GET", "/openapi.json"),
            ]:
                response = client.request(method, path, headers={"authorization": "Bearer no"})
                assert response.status_code == 401, path
                assert response.headers["www-authenticate"].startswith("Bearer")
                assert response.json()["error"]["code"] == "invalid_api_key"
            assert client.get("/health").status_code == 200
            for header in ("Bearer sekret", "bearer sekret", "BEARER  sekret"):
                response = client.get("/v1/models", headers={"authorization": header})
                assert response.status_code == 200, header
            # the body of an unauthorised request is never read, whatever it claims to be
            head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 20000000\r\n\r\n"
            assert raw_request(server, head).startswith(b"HTTP/1.1 401")
    finally:
        server.stop()
    opened = RunningServer(
        tiny_engine(tiny_model_dir, num_kv_blocks=64), api_key="k", open_metrics=True
    )
    try:
        assert httpx.get(f"{opened.url}/metrics").status_code == 200
        assert httpx.get(f"{opened.url}/v1/models").status_code == 401
    finally:
        opened.stop()


def test_priority_only_where_allowed(tiny_model_dir: Path) -> None:
    server = RunningServer(tiny_engine(tiny_model_dir, num_kv_blocks=64), allow_priority=True)
    try:
        url = f"{server.url}{COMPLETION}"
        body = {"prompt": "hi", "max_tokens": 2, "priority": -3}
        assert httpx.post(url, json=body, timeout=30).status_code == 200
        assert_error(httpx.post(url, json={**body, "priority": 2**63}), 400, "priority")
    finally:
        server.stop()


@pytest.mark.engine_errors
def test_a_failing_step_is_a_500_for_its_requests_only(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = RunningServer(tiny_engine(tiny_model_dir, num_kv_blocks=64, max_num_seqs=2))
    execute = server.engine.runner.execute
    poisoned = {"armed": True}

    def failing_execute(runs: Any, rows: Any) -> Any:
        if poisoned["armed"] and any(list(r.token_ids[:3]) == [7, 7, 7] for r in runs):
            poisoned["armed"] = False
            raise RuntimeError("injected fault")
        return execute(runs, rows)

    monkeypatch.setattr(server.engine.runner, "execute", failing_execute)

    async def clients() -> tuple[httpx.Response, list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            plain = client.post(COMPLETION, json={"prompt": [7, 7, 7, 8], "max_tokens": 4})
            events: list[str] = []

            async def stream() -> None:
                body = {"prompt": [7, 7, 7, 9], "max_tokens": 4, "stream": True}
                async with client.stream("POST", COMPLETION, json=body) as response:
                    events.extend([line async for line in response.aiter_lines() if line])

            await asyncio.sleep(0)
            first, _ = await asyncio.gather(plain, stream())
            other = await client.post(COMPLETION, json={"prompt": [7, 7, 7, 8], "max_tokens": 4})
            return first, events, other

    try:
        first, events, other = asyncio.run(clients())
        assert events[-1] == "data: [DONE]"
        payloads = [json.loads(e[6:]) for e in events[:-1]]
        failed = [p for p in payloads if "error" in p]
        if first.status_code == 500:  # the plain request was in the failing step
            assert first.json()["error"]["code"] == "engine_step_failed"
        else:
            assert failed
        if failed:
            assert failed[0]["error"]["type"] == "server_error"
        assert first.status_code == 500 or failed
        assert other.status_code == 200
        assert server.engine.stats.num_failed_steps == 1
        assert server.engine.cache.num_free_blocks == server.engine.num_kv_blocks
    finally:
        server.stop()
