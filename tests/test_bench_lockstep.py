"""The benchmarks' lockstep runner (``benchmarks/spec_decode.run_lockstep``) against running
each engine alone: same outputs, same tokens, and the order of steps it promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.spec_decode import run, run_lockstep
from specbatch import LLMEngine
from specbatch.config import EngineConfig

PROMPTS = [[5, 17, 33, 5, 17, 33, 5, 17], [40, 41, 42, 43], [7] * 12]


def _engine(model: Path, speculative: dict[str, Any] | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            num_kv_blocks=96,
            max_model_len=128,
            block_size=8,
            enable_prefix_caching=False,
            speculative_config=speculative,
        )
    )


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_lockstep_generates_what_each_engine_generates_alone(
    tiny_model_dir: Path, concurrency: int
) -> None:
    specs = {"off": {"method": "off"}, "ngram": {"method": "ngram", "num_speculative_tokens": 3}}
    alone = {
        name: run(_engine(tiny_model_dir, spec), PROMPTS, 24, concurrency)
        for name, spec in specs.items()
    }
    engines = {name: _engine(tiny_model_dir, spec) for name, spec in specs.items()}
    together = run_lockstep(engines, PROMPTS, 24, concurrency)
    for name in specs:
        assert together[name]["outputs"] == alone[name]["outputs"]
        assert together[name]["tokens"] == alone[name]["tokens"] == 3 * 24
        assert not engines[name].has_unfinished_requests()


def test_lockstep_steps_the_engine_furthest_behind(tiny_model_dir: Path) -> None:
    """Every step taken is one of an engine whose tokens so far are the fewest of the
    unfinished ones, so a speculating engine (several tokens a step on repetitive prompts)
    steps less often than off."""
    engines = {
        "off": _engine(tiny_model_dir, {"method": "off"}),
        "ngram": _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 4}),
    }
    emitted = {name: 0 for name in engines}
    finished = {name: False for name in engines}
    steps: list[tuple[str, dict[str, int]]] = []
    for name, engine in engines.items():
        original = engine.step
        counts: dict[str, int] = {}

        def step(name: str = name, original: Any = original, counts: Any = counts) -> Any:
            waiting = {n: emitted[n] for n in engines if not finished[n]}
            steps.append((name, waiting))
            outputs = original()
            for out in outputs:
                emitted[name] += len(out.outputs[0].token_ids) - counts.get(out.request_id, 0)
                counts[out.request_id] = len(out.outputs[0].token_ids)
            finished[name] = not engines[name].has_unfinished_requests()
            return outputs

        engine.step = step  # type: ignore[method-assign]
    repetitive = [[3, 4, 5, 6] * 6, [9, 8, 7] * 8]
    results = run_lockstep(engines, repetitive, 32, 2)
    for name, waiting in steps:
        assert waiting[name] == min(waiting.values()), (name, waiting)
    counts_by_engine = {name: sum(1 for n, _ in steps if n == name) for name in engines}
    assert counts_by_engine["ngram"] < counts_by_engine["off"]
    for name in engines:
        assert results[name]["tokens"] == emitted[name] == 64
