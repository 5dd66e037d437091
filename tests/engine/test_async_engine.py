"""AsyncEngine under the ways asyncio code gives up or stops: a cancelled add, a drain that
meets requests still being tokenized, a shutdown with adds queued. Nothing hangs, nothing kills
the loop, every caller gets an answer."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest

from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.engine.async_engine import AsyncEngine, EngineDeadError, EngineDrainingError

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=128, block_size=8)
    )


def slow_tokenizer(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    tokenize = engine.intake.tokenize

    def slow(text: str, param: str = "prompt") -> list[int]:
        time.sleep(seconds)
        return tokenize(text, param)

    monkeypatch.setattr(engine.intake, "tokenize", slow)


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
    deadline = time.monotonic() + 5
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_drain_answers_requests_still_being_tokenized(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_tokenizer(engine, monkeypatch, 0.5)

    async def scenario() -> None:
        async_engine = AsyncEngine(engine=engine)
        async_engine.start()
        adding = asyncio.ensure_future(async_engine.add_request("tokenizing", PARAMS))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await async_engine.drain(timeout=5.0)  # waits for the add, which is then refused
        assert time.monotonic() - started < 2.0
        with pytest.raises(EngineDrainingError):
            await adding
        with pytest.raises(EngineDrainingError):
            await async_engine.add_request([5], PARAMS)
        await async_engine.shutdown(timeout=1.0)
        with pytest.raises(EngineDeadError):
            await async_engine.add_request([5], PARAMS)

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert not engine.has_unfinished_requests()


def test_tokenizing_happens_off_the_event_loop(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_tokenizer(engine, monkeypatch, 1.0)

    async def scenario() -> float:
        async_engine = AsyncEngine(engine=engine)
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        clock = asyncio.ensure_future(ticker())
        await async_engine.generate_final("slow to tokenize", PARAMS)
        clock.cancel()
        await async_engine.shutdown()
        return max(b - a for a, b in itertools.pairwise(ticks))

    assert asyncio.run(scenario()) < 0.5  # the loop kept ticking through a 1 s tokenization
