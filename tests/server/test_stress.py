"""The server under stress: disconnects, malformed bodies, limits, keys, metrics, shutdown."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specbatch import SamplingParams
from tests.server.conftest import RunningServer, tiny_engine


def wait_until(condition: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_200_streams_with_random_disconnects_equal_solo_runs(
    server: RunningServer, tiny_model_dir: Path
) -> None:
    """200 concurrent streams, a third of them dropped at random points: every completed one
    equals the same request run alone, and nothing is left running or holding blocks."""
    url = f"{server.url}/v1/completions"
    rng = random.Random(7)
    prompts = [f"prompt number {i} says {'x' * rng.randrange(12)}" for i in range(200)]
    drop_after = {i: rng.randrange(1, 12) for i in range(200) if rng.random() < 0.33}
    solo = tiny_engine(tiny_model_dir, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = {}
    for i, prompt in enumerate(prompts):
        if i not in drop_after:
            solo.add_request(str(i), prompt, params)
            while solo.has_unfinished_requests():
                for out in solo.step():
                    expected[i] = out.outputs[0].text

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        body = {"prompt": prompts[i], "max_tokens": 24, "temperature": 0, "stream": True}
        body["ignore_eos"] = True
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return response.status_code, None
            text, chunks = "", 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                chunks += 1
                if chunks == drop_after.get(i):
                    return response.status_code, None  # disconnect mid-stream
            return response.status_code, text

    async def run_all() -> list[tuple[int, str | None]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run_all())
    assert all(status == 200 for status, _ in results)
    for i, (_, text) in enumerate(results):
        if i not in drop_after:
            assert text == expected[i], i
    engine = server.engine
    assert wait_until(lambda: engine.cache.num_free_blocks == engine.num_kv_blocks)
    assert not engine.has_unfinished_requests()
    engine.cache.pool.check_consistency()


MALFORMED: list[tuple[str, Any, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'{"prompt": "\xff\xfe bad utf8"}', 400, None),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi " * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user"}], "top_logprobs": 50},
        400,
        "top_logprobs",
    ),
    ("/v1/chat/completions", [1, 2, 3], 400, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), MALFORMED)
def test_malformed_requests(
    server: RunningServer, path: str, body: Any, status: int, param: str | None
) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        if isinstance(body, bytes):
            response = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = client.post(path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"]
        if param is not None:
            assert error["param"] == param, error
        ok = client.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2})
        assert ok.status_code == 200


def test_metrics_parse_and_move(server: RunningServer) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    before = scrape()
    httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "metrics", "max_tokens": 5, "temperature": 0},
        timeout=30,
    )
    after = scrape()
    assert (
        after["specbatch_generation_tokens_total"]
        >= before["specbatch_generation_tokens_total"] + 5
    )
    assert after["specbatch_request_success_total"] > before.get(
        "specbatch_request_success_total", 0
    )
    assert after["specbatch_time_to_first_token_seconds_count"] > before.get(
        "specbatch_time_to_first_token_seconds_count", 0
    )
    for name in (
        "specbatch_num_requests_running",
        "specbatch_num_requests_waiting",
        "specbatch_kv_cache_usage_perc",
        "specbatch_spec_decode_num_draft_tokens_total",
        "specbatch_spec_decode_acceptance_rate",
        "specbatch_spec_decode_mean_accepted_length",
        "specbatch_spec_decode_num_tree_drafts_total",
        "specbatch_spec_decode_num_tree_moves_total",
        "specbatch_spec_controller_drafting_steps_total",
        "specbatch_spec_controller_drafts_allotted_total",
        "specbatch_spec_controller_seqs_drafting",
        "specbatch_spec_controller_candidates",
        "specbatch_spec_controller_drafts",
        "specbatch_spec_controller_expected_gain",
    ):
        assert name in after
    # speculation is on by default: the controller planned the decode steps and says what a
    # step and a verify row cost by its model
    assert after["specbatch_spec_controller_planned_steps_total"] > before.get(
        "specbatch_spec_controller_planned_steps_total", 0
    )
    assert after["specbatch_spec_controller_step_seconds"] > 0
    assert after["specbatch_spec_controller_row_seconds"] >= 0


def test_api_key(tiny_model_dir: Path) -> None:
    server = RunningServer(tiny_engine(tiny_model_dir, num_kv_blocks=64), api_key="sekret")
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        url = f"{server.url}/v1/completions"
        assert httpx.post(url, json=body).status_code == 401
        wrong = httpx.post(url, json=body, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        good = httpx.post(url, json=body, headers={"authorization": "Bearer sekret"}, timeout=30)
        assert good.status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()


def test_queue_limit_gives_429(tiny_model_dir: Path) -> None:
    server = RunningServer(
        tiny_engine(tiny_model_dir, max_num_seqs=1, num_kv_blocks=64), max_queued=2
    )

    async def flood() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": "slow", "max_tokens": 60, "ignore_eos": True}
            responses = await asyncio.gather(
                *(client.post(f"{server.url}/v1/completions", json=body) for _ in range(8))
            )
            return [r.status_code for r in responses]

    try:
        statuses = asyncio.run(flood())
        assert 429 in statuses
        assert 200 in statuses
        assert set(statuses) <= {200, 429}
    finally:
        server.stop()


def test_graceful_shutdown_ends_open_streams(tiny_model_dir: Path) -> None:
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=64)
    server = RunningServer(engine, shutdown_timeout=0.5)
    events: list[str] = []

    def reader() -> None:
        body = {"prompt": "go", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)

    import threading

    thread = threading.Thread(target=reader)
    thread.start()
    assert wait_until(lambda: len(events) > 2)
    server.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert events[-1] == "data: [DONE]"
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
