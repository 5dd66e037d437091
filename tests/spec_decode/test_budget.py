"""The speculation budget (``adaptive_k``): drafts per sequence per step for the most expected
tokens per second. The allotment is compared with an exhaustive search over every allotment;
the step-time model with the function it measures; the engine with its fixed-k output."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from specbatch import LLM, LLMEngine
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError
from specbatch.spec_decode.budget import DECAY, PRIOR, PROBE_AFTER, SpeculationBudget, StepTimes
from specbatch.spec_decode.config import SpeculativeConfig
from specbatch.spec_decode.oracle import OracleProposer
from tests.spec_decode.test_spec_engine import (
    GREEDY,
    engine_kwargs,
    greedy_tokens,
    prompts_with_repeats,
)


class LinearTimes:
    """A known step-time function standing in for the measured one."""

    ready = True

    def __init__(self, fixed: float, per_token: float) -> None:
        self.fixed, self.per_token = fixed, per_token

    def over(self, tokens: np.ndarray, around: float) -> np.ndarray:
        return self.fixed + self.per_token * tokens

    def observe(self, tokens: int, seconds: float) -> None:
        pass


def budget_with(
    times: LinearTimes, rates: list[float], per_draft: float = 0.0
) -> SpeculationBudget:
    budget = SpeculationBudget()
    budget.step_times = times  # type: ignore[assignment]
    budget.proposer_seconds_per_draft = per_draft
    # independent drafts: draft j of sequence i is emitted with probability rates[i] ** j
    budget.gains = lambda seq_id, lookahead: [  # type: ignore[method-assign]
        rates[seq_id] ** j for j in range(1, lookahead + 1)
    ]
    return budget


def exhaustive(budget: SpeculationBudget, lookaheads: list[int], base: int) -> float:
    """The best goodput over every allotment (the slow, obvious reference)."""
    best = 0.0
    for drafts in itertools.product(*(range(n + 1) for n in lookaheads)):
        best = max(best, goodput(budget, list(drafts), base))
    return best


def goodput(budget: SpeculationBudget, drafts: list[int], base: int) -> float:
    tokens = sum(1 + sum(budget.gains(i, k)) for i, k in enumerate(drafts))
    return tokens / budget.cost(base, sum(drafts))


@pytest.mark.parametrize("seed", range(30))
def test_allotment_is_the_exhaustive_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 5))
    rates = rng.uniform(0, 1, count).tolist()
    if seed % 5 == 0:
        rates[0] = 1.0  # a sequence that is always right
    times = LinearTimes(float(rng.uniform(0.5, 2)), float(rng.choice([0.0, 0.01, 0.1, 0.5])))
    budget = budget_with(times, rates, per_draft=float(rng.choice([0.0, 0.05])))
    lookaheads = rng.integers(0, 4, count).tolist()
    base = count + int(rng.integers(0, 40))  # decodes plus some prefill
    drafts = budget.allot(list(range(count)), lookaheads, base)
    assert all(0 <= d <= most for d, most in zip(drafts, lookaheads, strict=True))
    assert goodput(budget, drafts, base) == pytest.approx(exhaustive(budget, lookaheads, base))


def test_allotment_follows_batch_size_and_acceptance() -> None:
    # a step of n tokens costs 1 + n / 64: drafts are nearly free for one sequence, all four
    # pay at acceptance 0.6; at 0.3 the fourth (emitted with probability 0.008) does not
    times = LinearTimes(1.0, 1 / 64)
    assert budget_with(times, [0.6]).allot([0], [4], 1) == [4]
    assert budget_with(times, [0.3]).allot([0], [4], 1) == [3]
    # 32 sequences at acceptance 0.3: a first draft gains 0.3 tokens, one more row costs a
    # 96th of a step that already makes 32 tokens: worth 0.33 tokens; none pays
    many = budget_with(times, [0.3] * 32)
    assert many.allot(list(range(32)), [4] * 32, 32) == [0] * 32
    # the same batch with some sequences that copy their prompt: only those draft
    rates = [0.95 if i % 4 == 0 else 0.3 for i in range(32)]
    drafts = budget_with(times, rates).allot(list(range(32)), [4] * 32, 32)
    assert [d > 0 for d in drafts] == [i % 4 == 0 for i in range(32)]


def estimate(times: StepTimes, tokens: float) -> float:
    return float(times.over(np.array([tokens], dtype=np.float64), tokens)[0])


def test_step_times_interpolate_and_extend() -> None:
    times = StepTimes()
    assert not times.ready
    for tokens in (1, 4, 8, 64, 200):
        for _ in range(3):
            times.observe(tokens, 0.01 + 0.002 * tokens)
    assert times.ready
    for tokens in (1, 2, 6, 30, 100, 150, 400):
        assert estimate(times, tokens) == pytest.approx(0.01 + 0.002 * tokens, rel=0.02)
    # sizes within 12.5% above 16 tokens share one smoothed point
    shared = StepTimes()
    shared.observe(100, 1.0)
    shared.observe(104, 2.0)
    assert len(shared._points) == 1


def test_step_times_never_decrease_past_the_ends() -> None:
    times = StepTimes()
    times.observe(10, 1.0)
    times.observe(20, 0.9)  # noise: the bigger step measured faster
    assert estimate(times, 40) == pytest.approx(estimate(times, 20))
    assert estimate(times, 15) <= estimate(times, 20) + 1e-12


def test_explores_both_before_it_can_compare() -> None:
    budget = SpeculationBudget()
    first, second = budget.allot([0, 1], [3, 2], 2), budget.allot([0, 1], [3, 2], 2)
    assert sorted([first, second]) == [[0, 0], [3, 2]]


def test_acceptance_estimate_decays() -> None:
    budget = SpeculationBudget()
    assert budget.acceptance(7) == 0.5
    budget.observe_verify(7, 4, 4)  # the first draft accepted
    assert budget.acceptance(7) == pytest.approx((DECAY * PRIOR + 1) / (2 * DECAY * PRIOR + 1))
    for _ in range(60):
        budget.observe_verify(7, 3, 0)
    assert budget.acceptance(7) < 0.01
    budget.forget(7)
    assert budget.acceptance(7) == 0.5


def test_bursty_acceptance_is_learned_per_position() -> None:
    """All or nothing (a lookup that is either right throughout or wrong at once): later drafts
    are as likely as the first, not its powers."""
    budget = SpeculationBudget()
    for step in range(400):
        budget.observe_verify(step % 7, 4, 4 if step % 2 else 0)
    gains = budget.gains(0, 4)
    assert gains[0] == pytest.approx(0.5, abs=0.15)
    assert gains[3] > 0.9 * gains[0]
    # drafts accepted independently at 0.5: each later one halves
    independent = SpeculationBudget()
    rng = np.random.default_rng(0)
    for step in range(2000):
        accepted = 0
        while accepted < 4 and rng.random() < 0.5:
            accepted += 1
        independent.observe_verify(step % 7, 4, accepted)
    follow = [independent.follow_on(p) for p in (1, 2, 3)]
    assert follow == pytest.approx([0.5, 0.5, 0.5], abs=0.12)


def adaptive_engine(
    model_dir: Path, truth: dict[str, list[int]], acceptance: float, per_token: float
) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            **engine_kwargs(),
            speculative_config={
                "method": "external",
                "num_speculative_tokens": 4,
                "adaptive_k": True,
            },
        ),
        proposer=OracleProposer(truth, acceptance, 300, seed=3),
    )
    assert engine.speculator.budget is not None
    engine.speculator.budget.step_times = LinearTimes(1.0, per_token)  # type: ignore[assignment]
    return engine


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert engine.speculator.budget is not None
    assert not engine.speculator.budget._acceptance  # finished sequences are forgotten
    assert not engine.speculator.budget._idle
    return [outputs[str(i)] for i in range(len(prompts))]


# a row costs an eighth of a one-sequence step, or a 64th of a step of one (for 32 sequences)
@pytest.mark.parametrize(("batch", "per_token"), [(1, 1 / 8), (32, 1 / 64)])
def test_engine_drafts_what_pays_and_keeps_the_output(
    tiny_model_dir: Path, batch: int, per_token: float
) -> None:
    prompts = prompts_with_repeats(batch, seed=9)
    reference = greedy_tokens(LLM(str(tiny_model_dir), **engine_kwargs()), prompts)
    truth = {str(i): tokens for i, tokens in enumerate(reference)}
    per_step = {}
    for acceptance in (0.0, 1.0):
        engine = adaptive_engine(tiny_model_dir, truth, acceptance, per_token)
        assert run(engine, prompts) == reference
        per_step[acceptance] = engine.stats.num_draft_tokens / engine.stats.num_steps
    # always right: near k per sequence per step; never right: the drafts stop but for probes
    assert per_step[1.0] > 2 * min(batch, 4)
    assert per_step[0.0] < 0.25 * per_step[1.0]


def test_engine_adaptive_with_real_proposers(tiny_model_dir: Path, tiny_draft_dir: Path) -> None:
    prompts = prompts_with_repeats(12, seed=10)
    reference = greedy_tokens(LLM(str(tiny_model_dir), **engine_kwargs()), prompts)
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4, "adaptive_k": True},
        {
            "method": "hybrid",
            "model": str(tiny_draft_dir),
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "adaptive_k": True,
        },
    ):
        llm = LLM(str(tiny_model_dir), speculative_config=spec, **engine_kwargs())
        assert greedy_tokens(llm, prompts, batch=6) == reference
        assert llm.llm_engine.stats.num_drafts > 0


def test_adaptive_k_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="adaptive_k"):
        SpeculativeConfig.parse(
            {"method": "ngram", "num_speculative_tokens": 2, "adaptive_k": "yes"}
        )
    with pytest.raises(ConfigError, match="adaptive_k"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "adaptive_k": 1})


def test_idle_sequences_are_probed() -> None:
    budget = budget_with(LinearTimes(1.0, 1.0), [0.01, 0.01])  # drafting never pays
    allotted = [budget.allot([0, 1], [3, 0], 2) for _ in range(2 * PROBE_AFTER)]
    # sequence 0 gets one draft every PROBE_AFTER steps; sequence 1 has no slot for one
    assert [a[0] for a in allotted] == ([0] * (PROBE_AFTER - 1) + [1]) * 2
    assert all(a[1] == 0 for a in allotted)
