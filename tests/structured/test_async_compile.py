"""AsyncEngine compiles a constraint in a worker thread, within ``COMPILE_SECONDS``: the event
loop keeps running meanwhile, a compile past the bound is a 400-style error naming the field,
and the engine's own thread then finds the constraint compiled."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from specbatch import LLMEngine, SamplingParams, StructuredOutputsParams
from specbatch.config import EngineConfig
from specbatch.engine import async_engine as async_module
from specbatch.engine.async_engine import AsyncEngine
from specbatch.errors import InvalidRequestError
from specbatch.sampling_params import OutputKind

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}


def params() -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
        output_kind=OutputKind.FINAL_ONLY,
    )


@pytest.fixture
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=128, block_size=8)
    )


def test_compiles_off_the_loop_and_the_engine_thread_finds_it_cached(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    constraints = engine.intake.constraints
    compile_ = constraints.compile
    threads: list[str] = []

    def slow_compile(spec: StructuredOutputsParams) -> object:
        threads.append(threading.current_thread().name)
        time.sleep(0.3)  # a slow compile: the loop must keep ticking meanwhile
        return compile_(spec)

    monkeypatch.setattr(constraints, "compile", slow_compile)

    async def scenario() -> tuple[int, str]:
        async_engine = AsyncEngine(engine=engine)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        final = None
        async for out in async_engine.generate([5, 6, 7], params(), "a"):
            final = out
        ticker.cancel()
        await async_engine.shutdown()
        assert final is not None
        return ticks, final.outputs[0].text

    ticks, text = asyncio.run(scenario())
    assert ticks >= 10, "the event loop stalled during the compile"
    assert threads[0] != "MainThread"
    assert len(threads) >= 1
    assert text.startswith("[")


def test_a_compile_past_the_bound_is_refused_naming_the_field(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    constraints = engine.intake.constraints
    compile_ = constraints.compile

    def slow_compile(spec: StructuredOutputsParams) -> object:
        time.sleep(0.5)
        return compile_(spec)

    monkeypatch.setattr(constraints, "compile", slow_compile)
    monkeypatch.setattr(async_module, "COMPILE_SECONDS", 0.05)

    async def scenario() -> None:
        async_engine = AsyncEngine(engine=engine)
        with pytest.raises(InvalidRequestError) as refused:
            await async_engine.add_request([5, 6, 7], params(), "slow")
        assert refused.value.param == "structured_outputs.json"
        assert "did not compile within" in str(refused.value)
        # and the engine serves on
        monkeypatch.setattr(async_module, "COMPILE_SECONDS", 10.0)
        outs = [o async for o in async_engine.generate([5, 6], params(), "next")]
        assert outs[-1].finished
        await async_engine.shutdown()

    asyncio.run(scenario())
