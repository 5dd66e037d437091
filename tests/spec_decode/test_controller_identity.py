"""The goodput controller changes which drafts are verified, never what is generated: greedy
and seeded outputs equal speculation off for every method, with preemption (a cache too small
for the batch) and chunked prefill (a token budget smaller than the prompts) in the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.spec_decode.oracle import OracleProposer
from specbatch.spec_decode.step_times import StepCost
from tests.spec_decode.test_spec_engine import prompts_with_repeats

# 24 prompts of 9-35 tokens, 20 new tokens each, at most 16 at once in a cache of 40 blocks
# of 8 tokens (320 slots): sequences are preempted; a budget of 24 tokens chunks prompts.
TIGHT = {
    "num_kv_blocks": 40,
    "block_size": 8,
    "max_model_len": 128,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 24,
    "enable_prefix_caching": False,
}


def params(i: int, sampled: bool) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=20)
    return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def outputs(engine: LLMEngine, prompts: list[list[int]], sampled: bool) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params(i, sampled))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
    return [done[str(i)] for i in range(len(prompts))]


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
