"""Random add/abort/step sequences never leak, double-free or over-commit a cache block."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.scheduler import SchedulerOutput
from tests.helpers import check_blocks

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 40), st.integers(1, 30), st.integers(1, 3), st.booleans()
        ),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=30,
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            num_kv_blocks=20,
            block_size=4,
            max_model_len=72,
            max_num_batched_tokens=48,
            max_num_seqs=6,
        )
    )
    schedule = engine.scheduler.schedule

    def checked_schedule() -> SchedulerOutput:
        out = schedule()
        assert out.num_batched_tokens <= 48
        assert len(engine.scheduler.running) <= 6
        return out

    engine.scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    return engine


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_random_workloads_keep_the_pool_whole(engine: LLMEngine, ops: list[tuple]) -> None:
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, n, shared = op
            prompt = ([7] * 12 if shared else []) + list(range(3, 3 + length))
            request_id = f"r{len(added)}-{id(ops)}"
            engine.add_request(
                request_id,
                prompt[:60],
                SamplingParams(n=n, temperature=0.8, max_tokens=max_tokens, ignore_eos=True),
            )
            added.append(request_id)
        elif op[0] == "abort" and added:
            engine.abort(added[op[1] % len(added)])
        else:
            for _ in range(op[1]):
                engine.step()
                check_blocks(engine)
    for request_id in added:
        engine.abort(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
    check_blocks(engine)
