"""A batch-1 plan in plain floats (``single.plan_one``) against the arrays path it reimplements
(``GoodputController._plan_arrays``, the reference): the same plan, bit for bit, on random
step-time models, acceptance histories and candidates."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from specbatch.spec_decode.control import single
from specbatch.spec_decode.control.choices import (
    DRAFT,
    EXTERNAL,
    FORCED,
    LOOKUP_WAYS,
    Candidate,
    ControllerPlan,
)
from specbatch.spec_decode.control.controller import GoodputController
from specbatch.spec_decode.tuning import SpeculationTuning

# the default proposer (lookups and the draft model) the most often
WAYS = [(*LOOKUP_WAYS, DRAFT)] * 3 + [LOOKUP_WAYS, (DRAFT,), (EXTERNAL,), (*LOOKUP_WAYS, EXTERNAL)]


def learned(rng: random.Random) -> GoodputController:
    """A controller of random ways that has seen a random run: batch-1 steps of 1..9 rows at
    growing contexts (some prefills, some contended), draft forwards, verifies, early stops,
    calibrations, an application's proposer's times."""
    tuning = SpeculationTuning(
        hurdle=rng.choice([0.0, 0.03, 0.5]), probe_every=rng.choice([0, 1, 3, 16])
    )
    controller = GoodputController(rng.choice(WAYS), tuning)
    fixed, per_token = rng.uniform(0.002, 0.02), rng.choice([0.0, 1e-5, 1e-3])
    per_pair = rng.choice([0.0, 1e-9, 1e-7])
    for context in range(rng.randint(3, 200)):
        tokens = rng.choice([1, 1, 1, rng.randint(2, 9), rng.randint(10, 300)])
        pairs = tokens * (context + 20)
        seconds = (fixed + per_token * tokens + per_pair * pairs) * rng.uniform(0.9, 1.2)
        controller.observe_step(tokens, 1, pairs, seconds, rng.choice([1.0, 1.0, 0.3]))
        if rng.random() < 0.5:
            rows = rng.choice([1, 1, 2, rng.randint(3, 60)])
            controller.observe_draft_forward(rows, rng.uniform(1e-4, 2e-3) * rows**0.5)
        seq_id = rng.randint(0, 3)
        for way in controller.ways:
            drafts = rng.randint(0, 8)
            accepted = rng.randint(0, drafts)
            controller.observe_verify(seq_id, way, drafts, accepted, rng.uniform(0, drafts))
            if rng.random() < 0.3:
                controller.observe_beyond(way, rng.randint(1, 4), rng.randint(1, 4), 1)
            if rng.random() < 0.3:
                controller.observe_made(way, rng.randint(1, 8), rng.randint(0, 8))
        if rng.random() < 0.3:
            controller.observe_external(rng.randint(1, 8), rng.uniform(0, 1e-3))
        controller.acceptance.step += rng.choice([1, 1, 5])
    controller.plans_since_probe = rng.randint(0, 20)
    return controller


def candidate(rng: random.Random) -> Candidate:
    lookup = [rng.randint(0, 99) for _ in range(rng.choice([0, 1, 3, 12]))]
    return Candidate(
        seq_id=rng.randint(0, 5),
        slots=rng.randint(1, 8),
        context=rng.randint(0, 4000),
        lookup=lookup,
        lookup_n=rng.randint(1, 5) if lookup else 0,
        catch_up=rng.choice([1, 1, 2, rng.randint(3, 300)]),
        forced=[rng.randint(0, 99) for _ in range(rng.choice([0, 0, 0, 1, 4, 20]))],
    )


def both(
    controller: GoodputController, cand: Candidate, tokens: int, pairs: float, budget: int
) -> tuple[tuple[ControllerPlan, int], tuple[ControllerPlan, int]]:
    """The plan and the probe counter after it, by each path, from the same state."""
    out = []
    for path in ("one", "arrays"):
        mine = copy.deepcopy(controller)
        mine.acceptance.step += 1  # as ``plan`` counts the step before either path
        if path == "one":
            plan, probe = single.plan_one(mine, cand, tokens, pairs, budget, mine._probe_next())
            mine._count_plan(probe)
        else:
            plan = mine._plan_arrays([cand], tokens, 1, pairs, budget)
        out.append((plan, mine.plans_since_probe))
    return out[0], out[1]


def case(seed: int) -> tuple[GoodputController, Candidate, int, float, int]:
    """A random controller, candidate, step (a decode, or a prefill's chunk too) and budget."""
    rng = random.Random(seed)
    controller = learned(rng)
    cand = candidate(rng)
    tokens = rng.choice([1, 1, 1, rng.randint(2, 40)])
    return controller, cand, tokens, float(tokens * cand.context), rng.choice([0, 1, 3, 100, -1])


@pytest.mark.parametrize("seed", range(300))
def test_a_batch_one_plan_in_floats_is_the_arrays_plan(seed: int) -> None:
    controller, cand, tokens, pairs, budget = case(seed)
    assert controller.times.ready
    one, arrays = both(controller, cand, tokens, pairs, budget)
    assert one == arrays


def test_the_paths_agree_where_the_plan_drafts_and_where_it_probes() -> None:
    """The random cases above reach every branch: no drafts, each way chosen, a budget that
    cuts the plan, probes found and not, forced tokens; so a path that differs in one of them
    cannot pass by never meeting it."""
    seen = set()
    for seed in range(300):
        controller, cand, tokens, pairs, budget = case(seed)
        (plan, _), _ = both(controller, cand, tokens, pairs, budget)
        choice = plan.choices[0]
        seen.add(("way", choice.way if choice.way is None else choice.way.rstrip("123")))
        seen.add(("probe", choice.planned is not None))
        seen.add(("budget cut", 0 < budget < cand.slots and choice.drafts == budget))
    wanted = {("way", w) for w in (None, "lookup", DRAFT, EXTERNAL, FORCED)}
    wanted |= {("probe", True), ("probe", False), ("budget cut", True)}
    assert wanted <= seen


def test_plan_takes_the_float_path_at_batch_one_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan`` with one sequence in the step: ``plan_one``'s plan; with a prefill beside it
    (two sequences in the forward) the arrays'."""
    controller = learned(random.Random(7))
    cand = Candidate(0, 4, 100, [1, 2, 3], 3)
    calls = []
    original = single.plan_one

    def spy(*args: Any) -> ControllerPlan:
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(single, "plan_one", spy)
    controller.plan([cand], 1, 1, 100.0, 10)
    controller.plan([cand], 30, 2, 3000.0, 10)
    assert len(calls) == 1
