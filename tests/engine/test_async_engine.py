"""AsyncEngine under the ways asyncio code gives up or stops: a cancelled add, a drain that
meets requests still being tokenized, a shutdown with adds queued. Nothing hangs, nothing kills
the loop, every caller gets an answer."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.engine.async_engine import AsyncEngine, EngineDeadError, EngineDrainingError

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
WAIT = 60.0  # seconds: a guard against a hang, never a measure of speed


@pytest.fixture
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=128, block_size=8)
    )


def gated_tokenizer(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, gate: threading.Event
) -> tuple[threading.Event, list[bool]]:
    """Each tokenization first waits (at most ``WAIT`` seconds) for ``gate``. Returns an event
    set once a tokenization has begun, and whether each one found the gate open in time."""
    tokenize = engine.intake.tokenize
    begun = threading.Event()
    opened: list[bool] = []

    def gated(text: str, param: str = "prompt") -> list[int]:
        begun.set()
        opened.append(gate.wait(timeout=WAIT))
        return tokenize(text, param)

    monkeypatch.setattr(engine.intake, "tokenize", gated)
    return begun, opened


def test_a_cancelled_add_leaves_the_engine_alive(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = engine.step

    def slow_step() -> Any:
        time.sleep(0.05)  # the worker is busy when the add is cancelled
        return step()

    monkeypatch.setattr(engine, "step", slow_step)

    async def scenario() -> list[int]:
        async_engine = AsyncEngine(engine=engine)
        busy = await async_engine.add_request([5, 6, 7], PARAMS.clone(max_tokens=30))
        for _ in range(20):
            task = asyncio.ensure_future(async_engine.add_request([9, 10], PARAMS))
            await asyncio.sleep(0)  # queued, not yet taken by the worker
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert async_engine.is_running
        async for _ in busy:
            pass
        final = await async_engine.generate_final([9, 10], PARAMS)
        await async_engine.shutdown()
        return final.outputs[0].token_ids

    assert len(asyncio.run(scenario())) == 6
    deadline = time.monotonic() + WAIT
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_drain_answers_requests_still_being_tokenized(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    begun, opened = gated_tokenizer(engine, monkeypatch, release)

    async def scenario() -> None:
        async_engine = AsyncEngine(engine=engine)
        async_engine.start()
        adding = asyncio.ensure_future(async_engine.add_request("tokenizing", PARAMS))
        assert await asyncio.to_thread(begun.wait, WAIT)
        # a drain timeout far beyond the wait below: the drain must end when the add does
        draining = asyncio.ensure_future(async_engine.drain(timeout=100 * WAIT))
        for _ in range(10):  # the drain polls; it has had its turns and still waits for the add
            await asyncio.sleep(0.01)
        assert not draining.done()
        assert not adding.done()
        release.set()
        await asyncio.wait_for(draining, WAIT)  # the add was refused, and that ended the drain
        with pytest.raises(EngineDrainingError):
            await adding
        with pytest.raises(EngineDrainingError):
            await async_engine.add_request([5], PARAMS)
        await async_engine.shutdown(timeout=1.0)
        with pytest.raises(EngineDeadError):
            await async_engine.add_request([5], PARAMS)

    asyncio.run(asyncio.wait_for(scenario(), timeout=2 * WAIT))
    assert opened == [True]
    assert not engine.has_unfinished_requests()


def test_tokenizing_happens_off_the_event_loop(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the tokenization waits for a task on the event loop: on the loop itself it would block
    # that task, and find the gate still shut when its wait ran out
    loop_ran = threading.Event()
    begun, opened = gated_tokenizer(engine, monkeypatch, loop_ran)

    async def scenario() -> list[int]:
        async_engine = AsyncEngine(engine=engine)

        async def on_the_loop() -> None:
            while not begun.is_set():
                await asyncio.sleep(0.01)
            loop_ran.set()

        watcher = asyncio.ensure_future(on_the_loop())
        final = await async_engine.generate_final("tokenized in a thread", PARAMS)
        await watcher
        await async_engine.shutdown()
        return final.outputs[0].token_ids

    assert len(asyncio.run(scenario())) == 6
    assert opened == [True]  # the loop ran while the prompt was being tokenized
