"""The goodput controller changes which drafts are verified, never what is generated: greedy
and seeded outputs equal speculation off for every method, with preemption (a cache too small
for the batch) and chunked prefill (a token budget smaller than the prompts) in the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specbatch import LLMEngine
from specbatch.config import EngineConfig
from specbatch.spec_decode.control.step_times import StepCost
from tests.helpers import TIGHT, OracleProposer, outputs, prompts_with_repeats


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_with_repeats(24, seed=11)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path, prompts: list[list[int]]) -> dict[bool, list[list[int]]]:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), speculative_config={"method": "off"}, **TIGHT)
    )
    return {sampled: outputs(engine, prompts, sampled) for sampled in (False, True)}


@pytest.mark.parametrize("rows", ["free", "measured"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["auto", "ngram", "draft_model", "hybrid", "external"])
def test_controller_output_equals_speculation_off(
    tiny_model_dir: Path,
    tiny_draft_dir: Path,
    prompts: list[list[int]],
    plain: dict[bool, list[list[int]]],
    method: str,
    sampled: bool,
    rows: str,
) -> None:
    """``rows="free"``: the step-time model says verify rows cost nothing, so the controller
    drafts wherever a draft may be accepted (the verify path surely runs); ``"measured"``:
    whatever the measured times make it choose."""
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 3}
    proposer = None
    if method in ("draft_model", "hybrid"):
        spec["model"] = str(tiny_draft_dir)
    if method == "external":  # drafts the plain run's own outputs, a third of them corrupted
        truth = {str(i): out for i, out in enumerate(plain[sampled])}
        proposer = OracleProposer(truth, 0.67, 300, seed=5)
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), speculative_config=spec, **TIGHT), proposer
    )
    controller = engine.speculator.controller
    assert controller is not None
    if rows == "free":
        controller.times.fit = lambda tokens, seqs: StepCost(0.01, 0.0, 0.0, 0.0)  # type: ignore[method-assign]
        controller.draft_times.fit = lambda rows: (0.0, 0.0)  # type: ignore[method-assign]
    assert outputs(engine, prompts, sampled) == plain[sampled]
    stats = engine.stats
    assert stats.num_preemptions > 0
    assert stats.num_planned_steps > 0
    if rows == "free":
        assert stats.num_drafts > 0  # the controller gave drafts: the verify path ran
