"""The controller's bound (``_plain_unless_a_draft_pays``): where no draft can pay it answers
the plain step without building the plan's arrays, and its answer is the full plan's (the
reference), plan and probe counter alike, on random batched step-time models, acceptance
histories and candidates.

The cause it fixes, traced at batch 32 in the gguf mode (stop 61, math and stem): a verify
row cost what a decode does (0.033 of a 32-row step), so no draft paid on 94% of steps, yet
each of them built the candidates x ways x positions arrays: ~1 ms of a 112 ms step, most of
the 3-5% that put default speculation below off there (0.95x-0.96x)."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from specbatch.spec_decode.control.choices import (
    DRAFT,
    EXTERNAL,
    FORCED,
    LOOKUP_WAYS,
    SUFFIX,
    Candidate,
    ControllerPlan,
)
from specbatch.spec_decode.control.controller import GoodputController
from specbatch.spec_decode.tuning import SpeculationTuning

WAYS = [(*LOOKUP_WAYS, SUFFIX, DRAFT)] * 3 + [(*LOOKUP_WAYS, SUFFIX), (DRAFT,), (EXTERNAL,)]


def learned(rng: random.Random, per_row: float) -> GoodputController:
    """A controller of random ways that has seen a random batched run: steps of 2..64
    sequences each costing ``per_row`` seconds a row beyond a fixed part (some with drafts,
    some prefills, some contended), draft forwards, verifies, early stops, calibrations."""
    tuning = SpeculationTuning(
        hurdle=rng.choice([0.0, 0.03, 0.5]), probe_every=rng.choice([0, 1, 3, 16])
    )
    controller = GoodputController(rng.choice(WAYS), tuning)
    fixed, per_pair = rng.uniform(0.002, 0.02), rng.choice([0.0, 1e-9, 1e-7])
    for step in range(rng.randint(20, 200)):
        seqs = rng.choice([2, 8, 16, 32, 64])
        tokens = seqs + rng.choice([0, 0, 0, rng.randint(1, 3 * seqs), rng.randint(100, 3000)])
        pairs = tokens * (step + 50)
        seconds = (fixed + per_row * tokens + per_pair * pairs) * rng.uniform(0.9, 1.2)
        controller.observe_step(tokens, seqs, pairs, seconds, rng.choice([1.0, 1.0, 0.3]))
        if rng.random() < 0.5:
            rows = rng.randint(1, 64)
            controller.observe_draft_forward(rows, rng.uniform(1e-4, 2e-3) * rows**0.5)
        seq_id = rng.randint(0, 40)
        for way in controller.ways:
            drafts = rng.randint(0, 8)
            accepted = rng.randint(0, drafts)
            controller.observe_verify(seq_id, way, drafts, accepted, rng.uniform(0, drafts))
            if rng.random() < 0.3:
                controller.observe_made(way, rng.randint(1, 8), rng.randint(0, 8))
        if rng.random() < 0.3:
            controller.observe_external(rng.randint(1, 8), rng.uniform(0, 1e-3))
        controller.acceptance.step += rng.choice([1, 1, 5])
    controller.plans_since_probe = rng.randint(0, 20)
    return controller


def candidates(rng: random.Random, count: int) -> list[Candidate]:
    out = []
    for seq_id in rng.sample(range(50), count):
        lookup = [rng.randint(0, 99) for _ in range(rng.choice([0, 1, 3, 12]))]
        out.append(
            Candidate(
                seq_id=seq_id,
                slots=rng.randint(1, 8),
                context=rng.randint(0, 4000),
                lookup=lookup,
                lookup_n=rng.randint(1, 5) if lookup else 0,
                catch_up=rng.choice([1, 1, 2, rng.randint(3, 300)]),
                forced=[rng.randint(0, 99) for _ in range(rng.choice([0, 0, 0, 0, 1, 4]))],
                suffix=[rng.randint(0, 99) for _ in range(rng.choice([0, 0, 2, 9]))],
            )
        )
    return out


def plans(
    controller: GoodputController, cands: list[Candidate], budget: int
) -> tuple[tuple[ControllerPlan, int], tuple[ControllerPlan, int], bool]:
    """The plan and the probe counter after it, with the bound and without it (the full
    plan), from the same state; and whether the bound answered."""
    seqs = len(cands) + 2  # two sequences that sample without slots
    tokens, pairs = seqs, float(sum(c.context for c in cands))
    out = []
    answered = False
    for bound in (True, False):
        mine = copy.deepcopy(controller)
        if not bound:
            mine._plain_unless_a_draft_pays = lambda *args: None  # type: ignore[method-assign]
        else:
            answered = mine._plain_unless_a_draft_pays(cands, tokens, seqs, pairs) is not None
        plan = mine.plan(cands, tokens, seqs, pairs, budget)
        out.append((plan, mine.plans_since_probe))
    return out[0], out[1], answered


def case(seed: int) -> tuple[GoodputController, list[Candidate], int]:
    rng = random.Random(seed)
    # a row from nearly free (a few drafts pay) to a decode's price (none does)
    controller = learned(rng, rng.choice([1e-5, 1e-4, 1e-3, 3e-3]))
    return controller, candidates(rng, rng.choice([2, 8, 32])), rng.choice([0, 3, 100])


@pytest.mark.parametrize("seed", range(200))
def test_the_bound_answers_what_the_full_plan_would(seed: int) -> None:
    controller, cands, budget = case(seed)
    assert controller.times.ready
    bounded, full, _ = plans(controller, cands, budget)
    assert bounded == full


def blind_and_due(seed: int) -> tuple[GoodputController, list[Candidate], int]:
    """A case whose candidates have nothing a probe could land on (no lookup, nothing from
    the store, no forced tokens, a draft-model catch-up beyond ``probe_free``), a probe due."""
    controller, cands, budget = case(seed)
    cands = [
        dataclasses.replace(c, lookup=[], lookup_n=0, suffix=[], forced=[], catch_up=3 + c.slots)
        for c in cands
    ]
    controller.plans_since_probe = max(controller.tuning.probe_every - 1, 0)
    return controller, cands, budget


@pytest.mark.parametrize("seed", range(100))
def test_a_due_probe_with_nowhere_to_land_plans_alike(seed: int) -> None:
    controller, cands, budget = blind_and_due(seed)
    bounded, full, _ = plans(controller, cands, budget)
    assert bounded == full


def test_the_blind_cases_reach_the_bound_with_a_probe_due() -> None:
    """Some of them (else the test above compares the full plan with itself)."""
    reached = 0
    for seed in range(100):
        controller, cands, budget = blind_and_due(seed)
        due = budget > 0 and controller._probe_next() and DRAFT in controller.ways
        reached += due and plans(controller, cands, budget)[2]
    assert reached >= 5


def test_the_cases_reach_both_answers_and_a_probe_past_the_bound() -> None:
    """The bound answers some cases (else the test above compares the full plan with itself),
    not all, and some it answers are due a probe (which the full plan places)."""
    seen = set()
    for seed in range(200):
        controller, cands, budget = case(seed)
        (plan, _), _, answered = plans(controller, cands, budget)
        probed = any(c.planned is not None for c in plan.choices)
        seen.add(("answered", answered))
        seen.add(("answered, probed", answered and probed))
        seen.add(
            ("answered past a first row", answered and not first_rows_rule_out(controller, cands))
        )
    assert seen >= {
        ("answered", True),
        ("answered", False),
        ("answered, probed", True),
        ("answered past a first row", True),
    }


def first_rows_rule_out(controller: GoodputController, cands: list[Candidate]) -> bool:
    """Whether every candidate's best calibrated first chance is within its first row's
    worth (the bound before it counted follow-on chances, the plain step's shortfall and the
    draft model's forward): the cases must also meet steps that only the rest rules out."""
    seqs = len(cands) + 2
    pairs = float(sum(c.context for c in cands))
    most = max(c.slots for c in cands)
    worth = controller._first_rows([c.context for c in cands], most, seqs, seqs, pairs)[0]
    acceptance = controller.acceptance
    for way in (*controller.ways, FORCED):
        for c, tokens in zip(cands, worth, strict=True):
            if c.copied(way) != [] and tokens < 1.0:
                first = acceptance.calibration(way) * acceptance.first(c.seq_id, way)
                if first > tokens:
                    return False
    return True


def test_a_step_whose_rows_cost_a_decode_builds_no_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The traced steps: batch 32, a row priced at 1/32 of the step, lookups right 40-90% of
    the time. No draft pays, and the plan is the plain step without the arrays."""
    controller = GoodputController((*LOOKUP_WAYS, SUFFIX, DRAFT), SpeculationTuning())
    rng = random.Random(0)
    for step in range(64):
        controller.observe_step(32, 32, 32 * (150 + step), 0.110 * rng.uniform(0.98, 1.02))
        controller.observe_step(48, 32, 48 * (150 + step), 0.165 * rng.uniform(0.98, 1.02))
        for seq_id in range(32):
            accepted = int(rng.random() < 0.4 + seq_id / 64)
            controller.observe_verify(seq_id, LOOKUP_WAYS[-1], 1, accepted)
        controller.acceptance.step += 1
    cands = [Candidate(seq_id, 4, 200, [1, 2, 3, 4], 3, suffix=[5, 6]) for seq_id in range(32)]

    def built(*args: object) -> None:
        raise AssertionError("the plan's arrays were built for a step no draft can pay in")

    monkeypatch.setattr(controller, "_options", built)
    for _ in range(controller.tuning.probe_every - 1 - controller.plans_since_probe):
        plan = controller.plan(cands, 32, 32, 32 * 200.0, budget=128)
        assert all(choice.way is None for choice in plan.choices)
        assert plan.report.expected_gain == 1.0
        assert plan.prices.tokens_per_second > 0


def test_a_draft_model_whose_forward_cannot_pay_builds_no_arrays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The traced steps at batch 8 in the gguf mode (stop 62, math): a row costs ~1.4 ms of
    a 26 ms step at a short context, under the draft model's unmeasured first chance (0.5),
    so the first-row bound alone sent every step to the full plan (369 of 377 plans, 0.25 ms
    of controller a step); but any draft-model draft also runs its forward (3.0 ms fixed),
    which no batch of such drafts repays. The bound counts that forward, and the plan is the
    plain step without the arrays."""
    controller = GoodputController((*LOOKUP_WAYS, SUFFIX, DRAFT), SpeculationTuning())
    rng = random.Random(0)
    for step in range(64):
        for tokens in (8, 9, 10, 12):
            pairs = tokens * (100 + step)
            seconds = 0.0185 + 0.00097 * tokens + 4e-6 * pairs
            controller.observe_step(tokens, 8, pairs, seconds * rng.uniform(0.98, 1.02))
        for rows in (8, 16):
            controller.observe_draft_forward(rows, (0.0030 + 1e-4 * rows) * rng.uniform(0.98, 1.02))
        controller.acceptance.step += 1
    cands = [Candidate(seq_id, 4, 100, [], 0) for seq_id in range(8)]
    worth = controller._first_rows([c.context for c in cands], 4, 8, 8, 800.0)[0]
    first = controller.acceptance.calibration(DRAFT) * controller.acceptance.first(0, DRAFT)
    assert first > max(worth)  # a first row alone would not rule the draft model out

    def built(*args: object) -> None:
        raise AssertionError("the plan's arrays were built for a step no draft can pay in")

    monkeypatch.setattr(controller, "_options", built)
    for _ in range(controller.tuning.probe_every - 1 - controller.plans_since_probe):
        plan = controller.plan(cands, 8, 8, 800.0, budget=32)
        assert all(choice.way is None for choice in plan.choices)


@pytest.mark.parametrize("seed", range(100))
def test_a_candidate_beyond_reach_plans_alike_without_its_lookups(seed: int) -> None:
    """What the planner skips: a candidate whose first row costs a token or more at the
    hurdle's goodput gets no drafts whatever its lookups found, so the plan without them (no
    match, nothing from the store) is the plan with them (no probe due: a probe may land on
    any candidate's lookup)."""
    controller, cands, budget = case(seed)
    controller.tuning = dataclasses.replace(controller.tuning, probe_every=0)
    seqs = len(cands) + 2
    tokens, pairs = seqs, float(sum(c.context for c in cands))
    most = max(c.slots for c in cands)
    far = controller.beyond_reach([c.context for c in cands], most, tokens, seqs, pairs)
    blind = [
        dataclasses.replace(c, lookup=[], lookup_n=0, suffix=[]) if beyond else c
        for c, beyond in zip(cands, far, strict=True)
    ]
    seen = copy.deepcopy(controller).plan(cands, tokens, seqs, pairs, budget)
    unseen = copy.deepcopy(controller).plan(blind, tokens, seqs, pairs, budget)
    assert seen.choices == unseen.choices
    assert seen.prices == unseen.prices
    for choice, beyond in zip(seen.choices, far, strict=True):
        assert not (beyond and choice.drafts)


def test_some_candidates_are_beyond_reach_and_some_are_not() -> None:
    """The cases above meet both kinds (else the test compares a plan with itself)."""
    kinds = set()
    for seed in range(100):
        controller, cands, _budget = case(seed)
        seqs = len(cands) + 2
        pairs = float(sum(c.context for c in cands))
        most = max(c.slots for c in cands)
        kinds.update(controller.beyond_reach([c.context for c in cands], most, seqs, seqs, pairs))
    assert kinds == {True, False}


@pytest.mark.parametrize("seed", range(20))
def test_a_candidates_copies_are_what_each_way_would_copy(seed: int) -> None:
    """``Candidate.copies`` (and ``copied``, read from it) against the rule written out: a
    lookup drafts as the way of its matched length (capped at the longest), the store as
    SUFFIX, a constraint's forced tokens as FORCED; nothing else copies."""
    for cand in candidates(random.Random(seed), 32):
        rule = {}
        if cand.lookup:
            rule[LOOKUP_WAYS[min(cand.lookup_n, len(LOOKUP_WAYS)) - 1]] = cand.lookup
        if cand.suffix:
            rule[SUFFIX] = cand.suffix
        if cand.forced:
            rule[FORCED] = cand.forced
        asked = {way: cand.copied(way) for way in (*LOOKUP_WAYS, SUFFIX, FORCED)}
        assert dict(cand.copies()) == {way: copy for way, copy in asked.items() if copy} == rule
        assert cand.copied(DRAFT) is None
        assert cand.copied(EXTERNAL) is None


def test_a_due_probe_that_can_land_nowhere_builds_no_arrays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The traced steps at batch 64 in the gguf mode (stop 65, plain-text prompts): every
    candidate's lookups beyond reach (the planner made none) and the draft model sat out
    (its catch-up the whole prompt), so no probe could land; once one was due, each plan
    built the arrays to find none (0.7 ms of a 78 ms step, 2-3% below off with the plan's
    other host time). The plans past the due probe are the plain step without the arrays,
    and the probe still lands once a candidate can take it."""
    controller = GoodputController((*LOOKUP_WAYS, SUFFIX, DRAFT), SpeculationTuning())
    rng = random.Random(0)
    for step in range(64):
        controller.observe_step(64, 64, 64 * (150 + step), 0.078 * rng.uniform(0.98, 1.02))
        controller.observe_step(96, 64, 96 * (150 + step), 0.117 * rng.uniform(0.98, 1.02))
        controller.acceptance.step += 1
    blind = [Candidate(seq_id, 4, 200, [], 0, catch_up=180) for seq_id in range(64)]
    real = controller._options

    def built(*args: object) -> None:
        raise AssertionError("the plan's arrays were built where no probe can land")

    monkeypatch.setattr(controller, "_options", built)
    for _ in range(3 * controller.tuning.probe_every):
        plan = controller.plan(blind, 64, 64, 64 * 200.0, budget=256)
        assert all(choice.way is None for choice in plan.choices)
    assert controller._probe_next()
    monkeypatch.setattr(controller, "_options", real)
    cands = [*blind[:-1], Candidate(63, 4, 200, [7, 8], 2)]
    plan = controller.plan(cands, 64, 64, 64 * 200.0, budget=256)
    assert [(c.way, c.drafts, c.planned) for c in plan.choices if c.way] == [(LOOKUP_WAYS[1], 1, 0)]
    assert controller.plans_since_probe == 0


def test_a_new_batch_size_drafts_within_its_measured_shapes() -> None:
    """After batch 1's steps (rows nearly free) and a batch-16 prefill of 2,400 prompt
    tokens, the plain 16-decode step is the only batch-16 decode step timed: a fit there
    extrapolates a row's price, so a plan drafts at most as many rows as keep the step
    within one kernel width of a timed decode step (``StepTimes.reach``: ~2x its tokens),
    whatever the extrapolation says; once a wider step is timed, the next plan may go wider
    (Gemma 3 at batch 16 drafted 62-88 rows on its first steps at 4-5x the plain step's
    time)."""
    controller = GoodputController((*LOOKUP_WAYS, SUFFIX), SpeculationTuning(probe_every=0))
    rng = random.Random(0)
    for tokens in (1, 2, 3, 4, 5) * 8:  # batch 1: nearly flat
        controller.observe_step(tokens, 1, tokens * 200.0, 0.010 + 0.0002 * tokens)
    controller.observe_step(2400, 16, 2400 * 150.0, 0.40, decodes=False)  # the prefill
    for _ in range(4):
        controller.observe_step(16, 16, 16 * 200.0, 0.040 * rng.uniform(0.99, 1.01))
    for seq_id in range(16):
        for _ in range(8):
            controller.observe_verify(seq_id, SUFFIX, 4, 4)
    cands = [Candidate(i, 4, 200, [], 0, suffix=[1, 2, 3, 4]) for i in range(16)]
    reach = controller.times.reach(16)
    assert 31.0 < reach < 33.0  # the plain decode step's 16 tokens, one kernel width out
    first = controller.plan(cands, 16, 16, 16 * 200.0, budget=64)
    drafted = sum(c.drafts for c in first.choices)
    assert 0 < drafted <= int(reach) - 16
    controller.observe_step(16 + drafted, 16, (16 + drafted) * 200.0, 0.045)
    wider = controller.plan(cands, 16, 16, 16 * 200.0, budget=64)
    assert drafted < sum(c.drafts for c in wider.choices) <= int(controller.times.reach(16)) - 16
