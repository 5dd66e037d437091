"""``serve --data-parallel-size 2``: two engine processes behind one server. The openai
client's concurrent requests are all answered with one engine's greedy text; a prompt whose
prefix a replica holds goes there among equally loaded replicas; /metrics has each replica's
counters and their sum; a killed replica's streams end with an error event and the replica
comes back; the routing and the stats' sum against slow obvious versions."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from specbatch.config import EngineConfig
from specbatch.engine.data_parallel import DataParallelEngine, Replica, prefix_hashes
from specbatch.engine.stats import EngineStats
from specbatch.errors import ConfigError
from specbatch.server.app import ServerSettings
from specbatch.server.serve import server_for
from tests.server.conftest import free_port, tiny_engine

CONFIG: dict[str, Any] = {
    "num_kv_blocks": 256,
    "block_size": 8,
    "max_model_len": 256,
    "max_num_seqs": 32,
    "num_threads": 1,
}


class DataParallelServer:
    def __init__(self, model: Path) -> None:
        self.engine = DataParallelEngine(EngineConfig(model=str(model), **CONFIG), 2)
        self.port = free_port()
        self.server = server_for(
            self.engine,
            ServerSettings(served_model_name="tiny"),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def complete(self, prompt: str, max_tokens: int = 12) -> Any:
        return self.client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0
        )

    def metric(self, name: str) -> dict[str, float]:
        values = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + "{"):
                labels, value = line.rsplit(" ", 1)
                replica = labels.split('replica="')[1].split('"')[0]
                values[replica] = float(value)
        return values


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[DataParallelServer]:
    server = DataParallelServer(tiny_model_dir)
    yield server
    server.server.should_exit = True
    server.thread.join(timeout=60)
    assert not any(r.process.is_alive() for r in server.engine.replicas)


def one_engine_texts(model: Path, prompts: list[str], max_tokens: int) -> list[str]:
    engine = tiny_engine(model, num_threads=1)
    from specbatch import SamplingParams

    texts = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    texts.append(out.outputs[0].text)
    return texts


PROMPTS = [f"Request {i}: tell me about the number {i * 7}" for i in range(16)]


def test_concurrent_requests_are_answered_as_one_engine_answers(
    served: DataParallelServer, tiny_model_dir: Path
) -> None:
    before = served.metric("specbatch_generation_tokens_total")
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(served.complete, PROMPTS))
    assert [a.choices[0].text for a in answers] == one_engine_texts(tiny_model_dir, PROMPTS, 12)
    # both replicas served some; the sum row is their sum; the counts are what was answered
    time.sleep(1.2)  # two of the replicas' stats reports
    after = served.metric("specbatch_generation_tokens_total")
    per_replica = {r: after[r] - before.get(r, 0.0) for r in after}
    assert per_replica["0"] > 0
    assert per_replica["1"] > 0
    assert per_replica["all"] == per_replica["0"] + per_replica["1"]
    assert per_replica["all"] == sum(a.usage.completion_tokens for a in answers)
    # each replica keeps its own store of the requests it finished (the default keeps one)
    held = served.metric("specbatch_spec_suffix_store_requests")
    assert held["0"] > 0
    assert held["1"] > 0
    assert held["all"] == held["0"] + held["1"]
    assert held["all"] == sum(r.stats.num_requests_finished for r in served.engine.replicas)


def test_a_prompt_goes_to_the_replica_holding_its_prefix(served: DataParallelServer) -> None:
    """Replica 0 is kept busy while a long prompt goes to replica 1; once both are idle
    again, a prompt sharing that prefix goes to replica 1 (not to replica 0, first among
    equals) and finds the prefix cached."""
    shared = "The quick brown fox jumps over the lazy dog near the river bank. " * 2
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(served.complete, "keep replica zero busy for a while", 120)
        deadline = time.monotonic() + 10
        while not any(r.in_flight for r in served.engine.replicas):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        holder = next(r.index for r in served.engine.replicas if not r.in_flight)
        first = served.complete(shared + "First question?")
        busy.result()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    while any(r.in_flight for r in served.engine.replicas):
        time.sleep(0.01)
    time.sleep(1.2)  # two of the replicas' stats reports
    counts = {r.index: r.stats.num_prompt_tokens for r in served.engine.replicas}
    second = served.complete(shared + "Second question?")
    assert second.usage.prompt_tokens_details.cached_tokens >= 8 * 8
    time.sleep(1.2)
    grew = [r.index for r in served.engine.replicas if r.stats.num_prompt_tokens > counts[r.index]]
    assert grew == [holder]


@pytest.mark.engine_errors
def test_a_killed_replica_ends_its_streams_with_an_error_and_comes_back(
    served: DataParallelServer, caplog: pytest.LogCaptureFixture
) -> None:
    victim = served.engine.replicas[0]
    old_pid = victim.pid
    assert old_pid is not None
    events: list[str] = []

    def stream() -> None:
        body = {"model": "tiny", "prompt": "a long story", "max_tokens": 200, "stream": True}
        body["temperature"] = 0
        body["ignore_eos"] = True
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    # the streams land on both replicas (least loaded): at least one on the victim
    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(events) < 4 or not victim.in_flight:
        assert time.monotonic() < deadline, events
        time.sleep(0.01)
    os.kill(old_pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a stream hung after its replica died"
    errors = [json.loads(e) for e in events if e.startswith('{"error"')]
    assert len(errors) == 1
    assert "replica 0 died" in errors[0]["error"]["message"]
    assert events.count("[DONE]") == 2
    deadline = time.monotonic() + 60
    while not victim.up:
        assert time.monotonic() < deadline, "the replica was not restarted"
        time.sleep(0.1)
    assert victim.pid != old_pid
    assert victim.restarts == 1
    # it serves again: with the other replica kept busy, the next request goes to it
    answers = [served.complete(p) for p in PROMPTS[:2]]
    assert all(a.choices[0].text for a in answers)
    assert httpx.get(f"{served.url}/health").status_code == 200
    logged = [r.getMessage() for r in caplog.records if r.name == "specbatch"]
    assert logged == [
        "data-parallel replica 0 died (exit code -9); its requests were lost: retry; "
        "starting it again"
    ]


def test_streams_dropped_at_random_leave_nothing_in_flight(
    served: DataParallelServer, tiny_model_dir: Path
) -> None:
    """100 concurrent streams over HTTP, a third dropped mid-stream: the finished ones are one
    engine's text, and once all are done no replica holds a request nor counts one waiting."""
    import random

    rng = random.Random(3)
    prompts = [f"stream {i} {'y' * rng.randrange(9)}" for i in range(100)]
    drop_after = {i: rng.randrange(1, 10) for i in range(100) if rng.random() < 0.33}

    async def one(client: httpx.AsyncClient, i: int) -> str | None:
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 16, "temperature": 0}
        body.update(stream=True, ignore_eos=True)
        text, chunks = "", 0
        async with client.stream("POST", f"{served.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                chunks += 1
                if chunks == drop_after.get(i):
                    return None  # disconnect mid-stream
        return text

    async def run_all() -> list[str | None]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    texts = asyncio.run(run_all())
    kept = [i for i in range(100) if i not in drop_after]
    engine = tiny_engine(tiny_model_dir, num_threads=1)
    from specbatch import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i in kept:
        engine.add_request(str(i), prompts[i], params)
    solo = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                solo[int(out.request_id)] = out.outputs[0].text
    assert [texts[i] for i in kept] == [solo[i] for i in kept]
    deadline = time.monotonic() + 20
    while any(r.in_flight for r in served.engine.replicas) or served.engine.num_waiting():
        assert time.monotonic() < deadline, [len(r.in_flight) for r in served.engine.replicas]
        time.sleep(0.05)


class _Fake(Replica):
    def __init__(self, index: int, in_flight: int, held: list[int]) -> None:
        self.index, self.up = index, True
        self.in_flight = {f"r{index}-{i}" for i in range(in_flight)}
        self.prefixes = dict.fromkeys(held)  # type: ignore[assignment]


def test_routing_is_least_loaded_then_longest_held_prefix() -> None:
    """Against the rule written out slowly: the fewest in flight; among those, the most
    leading blocks held; then the lowest index."""
    import random

    rng = random.Random(0)
    for _ in range(500):
        hashes = [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
        fakes = [
            _Fake(i, rng.randrange(3), hashes[: rng.randrange(len(hashes) + 1)] + [-1])
            for i in range(rng.randrange(1, 5))
        ]
        for fake in fakes:
            fake.up = rng.random() < 0.8
        live = [f for f in fakes if f.up]
        if not live:
            continue
        engine = object.__new__(DataParallelEngine)
        engine.replicas = fakes  # type: ignore[assignment]
        fewest = min(len(f.in_flight) for f in live)
        tied = [f for f in live if len(f.in_flight) == fewest]

        def held(f: _Fake, hashes: list[int] = hashes) -> int:
            n = 0
            while n < len(hashes) and hashes[n] in f.prefixes:
                n += 1
            return n

        most = max(held(f) for f in tied)
        expected = min(f.index for f in tied if held(f) == most)
        assert engine._route(hashes).index == expected


def test_prefix_hashes_name_a_block_and_everything_before_it() -> None:
    a = prefix_hashes(list(range(20)), 8)
    assert len(a) == 2  # the partial third block is not cached, so not hashed
    assert prefix_hashes(list(range(16)) + [99] * 4, 8) == a
    b = prefix_hashes([0, 1, 2, 3, 4, 5, 6, 70] + list(range(8, 16)), 8)
    assert b[0] != a[0]
    assert b[1] != a[1]  # same second block, different first: different hash
    assert prefix_hashes([1, 2, 3], 8) == []


def test_stats_combined_are_the_sum() -> None:
    parts = [EngineStats(), EngineStats()]
    parts[0].num_generation_tokens, parts[1].num_generation_tokens = 5, 7
    parts[0].num_running, parts[1].num_running = 2, 3
    parts[0].num_drafts_per_pos, parts[1].num_drafts_per_pos = [4, 2], [1, 1, 1]
    parts[0].kv_cache_usage, parts[1].kv_cache_usage = 0.2, 0.4
    parts[0].num_accepted_tokens_by_way = {"suffix": 3, "lookup1": 1}
    parts[1].num_accepted_tokens_by_way = {"suffix": 4, "draft": 2}
    parts[0].suffix_store_requests, parts[1].suffix_store_requests = 10, 12
    total = EngineStats.combined(parts)
    assert total.num_accepted_tokens_by_way == {"suffix": 7, "lookup1": 1, "draft": 2}
    assert total.suffix_store_requests == 22
    assert total.num_generation_tokens == 12
    assert total.num_running == 5
    assert total.num_drafts_per_pos == [5, 3, 1]
    assert total.kv_cache_usage == pytest.approx(0.3)
    assert parts[0].num_drafts_per_pos == [4, 2]  # the parts are left as they were
    assert parts[0].num_accepted_tokens_by_way == {"suffix": 3, "lookup1": 1}


def test_bad_data_parallel_settings_are_refused(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir))
    with pytest.raises(ConfigError, match="data_parallel_size must be a positive integer"):
        DataParallelEngine(config, 0)
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        DataParallelEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2), 2)


def test_a_replica_that_cannot_load_is_a_named_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="replica 0 failed to load"):
        DataParallelEngine(EngineConfig(model=str(tmp_path)), 2)


def test_errors_cross_the_pipe_as_the_front_own_classes() -> None:
    """A replica's refusal is rebuilt by name: a ValueError (a schema a backend rejects, a
    library check) is the request's fault, a 400 as on one engine, never a 500."""
    from specbatch.engine.async_engine import EngineDeadError, RequestFailedError
    from specbatch.engine.data_parallel import _error, _report
    from specbatch.errors import InvalidRequestError

    refused = _error(*_report(InvalidRequestError("bad top_k", "top_k")))
    assert isinstance(refused, InvalidRequestError)
    assert refused.param == "top_k"
    assert isinstance(_error(*_report(ValueError("schema is not valid"))), InvalidRequestError)
    assert isinstance(_error(*_report(EngineDeadError("gone"))), EngineDeadError)
    assert isinstance(_error(*_report(RuntimeError("step"))), RequestFailedError)


def test_asyncio_api_without_a_server(tiny_model_dir: Path) -> None:
    """The library entry point: generate through the engine directly; bad input is the
    engine's own InvalidRequestError."""
    from specbatch import SamplingParams
    from specbatch.errors import InvalidRequestError

    engine = DataParallelEngine(EngineConfig(model=str(tiny_model_dir), **CONFIG), 2)

    async def main() -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=12)
        texts = []
        for prompt in PROMPTS[:2]:
            stream = await engine.add_request(prompt, params)
            final = None
            async for out in stream:
                final = out
            assert final is not None
            texts.append(final.outputs[0].text)
        with pytest.raises(InvalidRequestError, match="token id") as refused:
            await engine.add_request([10**9], SamplingParams(max_tokens=2))
        assert refused.value.param == "prompt"
        # streams closed early (one after an output, one at once): the replicas end them
        # and the front counts nothing in flight or waiting
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = await engine.add_request(PROMPTS[3], long)
        await stream.__anext__()
        stream.close()
        (await engine.add_request(PROMPTS[4], long)).close()
        deadline = time.monotonic() + 20
        while any(r.in_flight for r in engine.replicas):
            assert time.monotonic() < deadline, [r.in_flight for r in engine.replicas]
            await asyncio.sleep(0.05)
        assert engine.num_waiting() == 0
        await engine.shutdown(1.0)
        return texts

    assert asyncio.run(main()) == one_engine_texts(tiny_model_dir, PROMPTS[:2], 12)
