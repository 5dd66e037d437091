"""The goodput controller against a fake clock and oracle proposers.

Step times come from a known function of tokens, sequences and attention pairs (the fake
clock), acceptance from oracles of known rates; the controller learns both as the engine would
and must then choose what an exhaustive search over every per-sequence (way, count) finds."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest

from specbatch.runner.flat_batch import TokenRun
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler import ScheduledSequence, SchedulerOutput
from specbatch.sequence import Sequence
from specbatch.spec_decode.control.acceptance import (
    AcceptanceModel,
    DecayedRate,
    _PositionRates,
    _TimedRate,
)
from specbatch.spec_decode.control.choices import DRAFT, LOOKUP_WAYS, Candidate, Choice, Way
from specbatch.spec_decode.control.controller import GoodputController
from specbatch.spec_decode.control.solver import promising_depths
from specbatch.spec_decode.control.step_times import (
    CACHED_FITS,
    FAR,
    ForwardTimes,
    StepClock,
    StepTimes,
    _Ring,
    _weighted_fit,
    _weighted_fits,
)
from specbatch.spec_decode.plan import DraftPlan
from specbatch.spec_decode.plan import pairs_of as _pairs
from specbatch.spec_decode.proposers.base import Proposal
from specbatch.spec_decode.proposers.ngram import NgramProposer
from specbatch.spec_decode.speculator import Speculator
from specbatch.spec_decode.tuning import SpeculationTuning
from specbatch.spec_decode.verification.chain import VerifyResult

HURDLE, PROBE_EVERY = SpeculationTuning().hurdle, SpeculationTuning().probe_every


class FakeClock:
    """A step's seconds as a known function of its tokens, sequences and attention pairs."""

    def __init__(self, fixed: float, per_token: float, per_seq: float, per_pair: float = 0.0):
        self.fixed, self.per_token, self.per_seq, self.per_pair = (
            fixed,
            per_token,
            per_seq,
            per_pair,
        )

    def __call__(self, tokens: float, seqs: float, pairs: float = 0.0) -> float:
        return self.fixed + self.per_token * tokens + self.per_seq * seqs + self.per_pair * pairs


def trained(
    clock: FakeClock, ways: tuple[Way, ...] = (Way.EXTERNAL,), **tuning: Any
) -> GoodputController:
    """A controller whose step-time model has seen a varied run under ``clock`` (no hurdle
    unless ``tuning`` says: the plan must be the exact optimum)."""
    controller = GoodputController(ways, SpeculationTuning(**{"hurdle": 0.0, **tuning}))
    rng = random.Random(0)
    for _ in range(200):
        seqs = rng.randint(1, 64)
        tokens = seqs + rng.choice([0, 0, rng.randint(0, 4 * seqs), rng.randint(0, 2000)])
        pairs = rng.uniform(0, 200) * tokens
        controller.observe_step(tokens, seqs, pairs, clock(tokens, seqs, pairs))
    for _ in range(60):  # small batches with a prompt's chunk: shapes the tests plan at
        seqs = rng.randint(1, 8)
        tokens = seqs + rng.randint(0, 48)
        pairs = rng.uniform(0, 200) * tokens
        controller.observe_step(tokens, seqs, pairs, clock(tokens, seqs, pairs))
    return controller


def with_rates(
    controller: GoodputController, rates: dict[int, float], follow: float | None = None
) -> None:
    """Oracle acceptance: sequence i's first draft is right with ``rates[i]``, each later one
    (given the one before) with ``follow`` (default: the same rate as the first, for one
    sequence: independent drafts)."""
    acceptance = controller.acceptance
    acceptance.firsts = lambda way, seq_ids: [rates[i] for i in seq_ids]  # type: ignore[method-assign]
    later = next(iter(rates.values())) if follow is None else follow
    acceptance.follow_lists = lambda ways, count: [  # type: ignore[method-assign]
        [1.0] + [later] * (count - 1) for _ in ways
    ]


def gains_of(model: AcceptanceModel, seq_id: int, way: str, count: int) -> np.ndarray:
    """Chance that each of the sequence's next ``count`` drafts of ``way`` is emitted (it and
    every one before it accepted), given that it is made."""
    return model.first(seq_id, way) * np.cumprod(model.follow_rows((way,), count)[0])


def candidates(slots: list[int], context: int = 0) -> list[Candidate]:
    return [Candidate(i, n, context, []) for i, n in enumerate(slots)]


def goodput(
    clock: FakeClock,
    controller: GoodputController,
    plan: list[tuple[str | None, int]],
    cands: list[Candidate],
    base_tokens: int,
    base_pairs: float = 0.0,
) -> float:
    """Expected tokens per second of a plan, by the true clock and the oracle's rates."""
    tokens, seconds = float(len(cands)), 0.0
    drafts = 0
    pairs = base_pairs
    for (way, count), c in zip(plan, cands, strict=True):
        if count:
            assert way is not None
            tokens += gains_of(controller.acceptance, c.seq_id, way, count).sum()
            drafts += count
            pairs += sum(c.context + j for j in range(count))
    seconds = clock(base_tokens + drafts, len(cands), pairs)
    return tokens / seconds


def exhaustive(
    clock: FakeClock,
    controller: GoodputController,
    cands: list[Candidate],
    base_tokens: int,
    base_pairs: float = 0.0,
) -> float:
    """The best goodput over every per-sequence draft count (the slow, obvious reference)."""
    options = [range(c.slots + 1) for c in cands]
    return max(
        goodput(
            clock, controller, [(Way.EXTERNAL, n) for n in counts], cands, base_tokens, base_pairs
        )
        for counts in itertools.product(*options)
    )


def test_step_times_recover_a_linear_clock() -> None:
    clock = FakeClock(0.02, 0.0005, 0.0002, 1e-7)
    controller = trained(clock)
    for tokens, seqs in ((1, 1), (5, 1), (64, 64), (320, 64), (2048, 2)):
        cost = controller.times.fit(tokens, seqs)
        assert cost.per_token == pytest.approx(0.0005, rel=1e-3)
        assert cost.per_seq == pytest.approx(0.0002, rel=1e-3)
        assert cost.per_pair == pytest.approx(1e-7, rel=1e-3)
        assert cost.seconds(tokens, seqs, 100.0 * tokens) == pytest.approx(
            clock(tokens, seqs, 100.0 * tokens), rel=1e-6
        )


def test_step_times_follow_a_knee() -> None:
    """Memory-bound below 32 tokens (flat), compute-bound above: the slope near the step asked
    about is the one that counts."""
    times = StepTimes()
    for tokens in list(range(1, 9)) * 3 + [64, 80, 96, 128, 160] * 3:
        times.observe(tokens, 1, 0.0, max(0.016, 0.0005 * tokens))
    assert times.fit(3, 1).per_token < 0.0005 * 0.1
    assert times.fit(100, 1).per_token == pytest.approx(0.0005, rel=0.1)


@pytest.mark.parametrize("seed", range(40))
def test_step_time_fit_is_the_nonnegative_least_squares_optimum(seed: int) -> None:
    """The fit's coefficients, intercept included, are the non-negative least-squares optimum
    (scipy's NNLS on the weighted design is the reference), including when the unconstrained
    optimum has negative slopes or a negative intercept (half the seeds draw data whose line
    crosses zero above the origin)."""
    from scipy.optimize import nnls

    rng = np.random.default_rng(seed)
    count = int(rng.integers(6, 40))
    design = np.column_stack(
        [np.ones(count), rng.uniform(1, 50, (count, 3)) * rng.choice([0.0, 1.0], 3)]
    )
    intercept = 0.03 if seed % 2 else -0.03
    y = design @ np.r_[intercept, rng.normal(1e-3, 1e-3, 3)] + rng.normal(0, 1e-4, count)
    weight = rng.uniform(0.1, 1.0, count)
    coef = _weighted_fit(design, y, weight)
    root = np.sqrt(weight)
    reference, _ = nnls(design * root[:, None], y * root)
    assert (coef >= 0).all()
    assert coef == pytest.approx(reference, rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("seed", range(10))
def test_fits_in_one_computation_are_each_the_nonnegative_optimum(seed: int) -> None:
    """Several fits at once (a batch-1 plan's, one per draft position), some of whose lines
    cross zero above the origin and some not, some with unused slots (weight 0): each is
    its own NNLS optimum (the refit through the origin runs for the crossing ones together)."""
    from scipy.optimize import nnls

    rng = np.random.default_rng(100 + seed)
    count = int(rng.integers(24, 60))  # a dozen samples a fit at least: well conditioned
    columns = int(rng.integers(1, 4))
    design = np.column_stack([np.ones(count), rng.uniform(1, 50, (count, columns))])
    y = design @ np.r_[-0.03, rng.uniform(5e-4, 2e-3, columns)] + rng.normal(0, 1e-4, count)
    half = count // 2
    y[:half] += 0.06  # the first half's line crosses zero below the origin, the second's above
    weights = rng.uniform(0.1, 1.0, (7, count))
    weights[::2, half:] *= 1e-6  # even fits weigh the first half, odd ones the second
    weights[1::2, :half] *= 1e-6
    weights[:, rng.integers(0, count, 3)] = 0.0
    coefs = _weighted_fits(design, y, weights, True)
    for weight, coef in zip(weights, coefs, strict=True):
        root = np.sqrt(weight)
        reference, _ = nnls(design * root[:, None], y * root)
        assert (coef >= 0).all()
        assert coef == pytest.approx(reference, rel=1e-5, abs=1e-8)
    assert (coefs[:, 0] == 0).any()  # both kinds of fit occur
    assert (coefs[:, 0] > 0).any()


def test_far_steps_do_not_price_a_decode_step_at_nothing() -> None:
    """A fresh engine has timed a prefill (once during a CPU spell) and a few drafted steps,
    and no decode step yet: the decode step's time is an extrapolation, and no extrapolation
    is below zero. The steps are those a spell really left (a free intercept put the decode
    step at -1.5 s, and a plan priced rows against a free step)."""
    times = StepTimes()
    for tokens, pairs, ms in [
        (217, 23653, 136.4), (7, 1547, 24.6), (217, 23653, 485.8), (9, 1998, 186.4),
        (8, 1844, 41.1), (6, 1425, 39.6), (5, 1215, 40.3),
    ]:  # fmt: skip
        times.observe(tokens, 1, pairs, ms / 1000)
    fit = times.fit(1, 1)
    assert fit.fixed >= 0
    assert fit.seconds(1, 1, 246) > 0.002


def test_a_batch_steps_plain_time_is_what_its_decodes_took() -> None:
    """The steps a batch-64 run of the gguf mode timed (two prefills, then decodes of 64
    sequences at ~100 ms as their contexts grow): the plain step is predicted at what those
    decodes took, by the plan too. Fitted unconstrained, the per-pair slope came out negative
    and, clamped to 0 with the level left where it was, put the decode at 165-490 ms: every
    draft looked cheap against it, and coding at batch 64 ran at 0.86x of speculation off."""
    rng = np.random.default_rng(0)
    times = [(2048, 37, 58587, 5.246), (1604, 64, 47451, 4.221)]
    times += [(64, 64, 3716 + 64 * i, 0.1 + 0.004 * rng.standard_normal()) for i in range(14)]
    controller = GoodputController((DRAFT, *LOOKUP_WAYS))
    for tokens, seqs, pairs, seconds in times:
        controller.observe_step(tokens, seqs, pairs, seconds)
    pairs = 3716 + 64 * 14
    assert controller.times.fit(64, 64).seconds(64, 64, pairs) == pytest.approx(0.1, rel=0.1)
    plan = controller.plan(candidates([4] * 64, context=60), 64, 64, pairs, budget=256)
    assert plan.report.step_seconds == pytest.approx(0.1, rel=0.1)


def test_a_new_batch_shape_runs_plain_before_drafts_are_weighed_against_it() -> None:
    """compare_peers.py's batch 64 after a warm-up of two prompts: the only step timed with 64
    sequences was their prefill (2,705 tokens, 4.3 s), and a fit put the decode of those 64 at
    1.9 s against 130 ms (16 steps drafted at 350-500 ms each, 0.79x of speculation off). The
    plain step is run first; once it is timed, drafts that pay are planned again."""
    controller = GoodputController(LOOKUP_WAYS, SpeculationTuning(hurdle=0.0))
    for tokens, seqs, seconds in [(60, 2, 0.03), (2, 2, 0.012), (6, 2, 0.014), (2, 2, 0.012)]:
        controller.observe_step(tokens, seqs, tokens * 30.0, seconds)
    controller.observe_step(2705, 64, 2705 * 21.0, 4.3)
    with_rates(controller, dict.fromkeys(range(64), 1.0))
    cands = [Candidate(i, 4, 42, [7] * 4, 3) for i in range(64)]
    plan = controller.plan(cands, 64, 64, 64 * 42.0, budget=256)
    assert all(c.drafts == 0 for c in plan.choices)
    for step in range(4):  # plain decodes, then drafted ones, at 0.8 ms a row
        for drafts in (0, 64, 128) if step else (0,):
            controller.observe_step(64 + drafts, 64, (64 + drafts) * 43.0, 0.1 + 0.0008 * drafts)
    plan = controller.plan(cands, 64, 64, 64 * 42.0, budget=256)
    assert plan.report.step_seconds == pytest.approx(0.1, rel=0.1)
    assert sum(c.drafts for c in plan.choices) > 0


def test_a_free_row_at_a_long_context_is_priced_free() -> None:
    """At batch 1 the pairs are nearly rows x context, so the per-token and per-pair slopes
    trade off; a clock under which a row costs nothing at the context the steps run at must
    give a row price near 0 (clamping an unconstrained fit's negative per-pair slope priced
    it at 8 ms, a fifth of a decode step, and the controller stopped drafting lookups)."""
    times = StepTimes()
    rng = random.Random(0)
    for step in range(200):
        rows = rng.randint(1, 9)
        context = 700 + step  # the sequence grows; the true row cost goes from +1 to -1 ms
        pairs = rows * context + rows * (rows - 1) / 2
        times.observe(rows, 1, pairs, 0.040 + 0.008 * rows - 1e-5 * pairs)
    cost = times.fit(5, 1)
    assert abs(cost.row(800)) < 0.0005


def test_two_close_steps_do_not_price_rows_at_another_context() -> None:
    """The steps a fresh engine measured (SmolLM2 at batch 1, spec_decode.py's warm-up then a
    217-token prompt): the only 2-token steps ran at contexts 61 and 63, 1.1 ms apart. A
    per-pair slope fitted on those two alone (all the narrow kernel sees at 2 tokens) priced a
    row at context 229 at 83 ms, three decode steps, so the plan never drafted again and no
    2-token step came to correct it. The per-pair cost is fitted where contexts vary: a row
    costs what the 2-token steps cost over the 1-token ones (~5 ms), and a lookup that is
    right 85% of the time gets drafts."""
    times = StepTimes()
    steps = [(56, 0, 74.5), (5, 56, 29.0), (2, 61, 29.1), (2, 63, 30.2), (1, 65, 29.6)]
    steps += [(217, 0, 151.4)] + [(1, context, 24.0) for context in range(218, 230)]
    for tokens, start, ms in steps:
        times.observe(tokens, 1, tokens * start + tokens * (tokens + 1) / 2, ms / 1000)
    two, one = times.fit(2, 1).seconds(2, 1, 2 * 229 + 3), times.fit(1, 1).seconds(1, 1, 230)
    assert 0.0 <= two - one < 0.007
    controller = GoodputController(LOOKUP_WAYS, SpeculationTuning(hurdle=0.0))
    controller.times = times
    with_rates(controller, {0: 0.85})
    choice = controller.plan([Candidate(0, 8, 229, [5] * 8, 3)], 1, 1, 230.0, budget=8).choices[0]
    assert choice.way == Way.LOOKUP3
    assert choice.drafts >= 1


@pytest.mark.parametrize("seed", range(6))
def test_a_rings_weights_are_each_samples_age_decay_and_contention(seed: int) -> None:
    """Each stored sample's weight is ``step_age_decay`` per sample since it arrived, times
    ``FAR`` where its share of the cores fell below the window's contended bar; 0 for slots
    never used. Checked after every sample, against the window written out, past a wrap."""
    rng = random.Random(seed)
    tuning = SpeculationTuning(step_window=rng.choice([3, 8, 64]))
    window = tuning.step_window
    ring = _Ring(window, tuning)
    shares: list[float] = []
    for _ in range(3 * window):
        share = rng.choice([1.0, 0.97, 0.9, 0.2, 0.0, float("nan")])
        slot = ring.add(share)
        shares.append(share if share > 0 and share == share else 1.0)
        assert slot == (len(shares) - 1) % window
        held = shares[-window:]
        bar = float(np.quantile(held, tuning.contention_quantile)) * tuning.contended_share
        expected = np.zeros(window)
        for age, kept in enumerate(reversed(held)):
            number = len(shares) - 1 - age
            contended = FAR if min(held) < bar and kept < bar else 1.0
            expected[number % window] = tuning.step_age_decay**age * contended
        assert ring.weights() == pytest.approx(expected, rel=1e-12, abs=0.0)


def test_forward_times_fit_fixed_and_per_row() -> None:
    times = ForwardTimes()
    for rows in (1, 2, 4, 8, 16, 3, 5):
        times.observe(rows, 0.004 + 0.0001 * rows)
    fixed, per_row = times.fit(4)
    assert fixed == pytest.approx(0.004, rel=1e-3)
    assert per_row == pytest.approx(0.0001, rel=1e-3)


@pytest.mark.parametrize("seed", range(8))
def test_a_draft_forwards_line_is_the_general_fits(seed: int) -> None:
    """A draft forward's fit, a weighted line in closed form over the samples grouped by row
    count, against the general weighted least squares (``_weighted_fit``, unconstrained) on
    every sample with its weight (contended ones too)."""
    rng = np.random.default_rng(seed)
    times = ForwardTimes()
    shapes = [1, 2, 3, 5, 8, 40, 120]  # each measured: no fit is the far reading
    for rows in shapes + list(rng.choice(shapes, int(rng.integers(0, 80)))):
        share = float(rng.choice([1.0, 1.0, 1.0, 0.2]))  # some timed contended (weighed FAR)
        times.observe(int(rows), 0.001 + 0.0002 * rows + float(rng.normal(0, 5e-5)), share)
    for rows in (1.0, 2.0, 5.0, 37.0, 120.0, 480.0):
        near = np.log(times._design[:, 1] / rows) ** 2
        bandwidth = times.tuning.bandwidth
        weight = times._ring.weights() * (np.exp(-near / (2 * bandwidth**2)) + FAR)
        fixed, per_row = _weighted_fit(times._design, times._y, weight, constrained=False)
        assert times._fit(rows) == pytest.approx((fixed, per_row), rel=1e-6, abs=1e-12)


def test_fits_asked_at_ever_new_rows_stay_within_the_memo_bound() -> None:
    """A draft model that never runs gets no samples while each step asks its fit at a new
    row count (its catch-up's): the memo keeps at most ``CACHED_FITS`` of them, and every
    answer, cached or refitted, is the fit computed afresh."""
    times = ForwardTimes()
    for rows in (1, 2, 4, 8, 16):
        times.observe(rows, 0.003 + 0.0001 * rows)
    for rows in range(1, 10 * CACHED_FITS):
        assert times.fit(float(rows)) == times._fit(float(rows))
        assert times.fit(1.0) == times._fit(1.0)
        assert len(times._cache._fits) <= CACHED_FITS


def test_a_far_draft_forward_does_not_rule_small_ones_out() -> None:
    """Measured once on a prompt's catch-up (59 rows, 7 ms), the draft model is not taken to
    cost 7 ms a forward at batch 1 (a plan would never draft, so never learn better): far from
    any measurement the fit reads it all as per-row cost, and once small forwards are measured
    the local fit holds."""
    times = ForwardTimes()
    times.observe(59, 0.007)
    fixed, per_row = times.fit(1)
    assert fixed == 0.0
    assert per_row == pytest.approx(0.007 / 59)
    clock = FakeClock(0.015, per_token=0.0005, per_seq=0.0)
    controller = trained(clock, (Way.LOOKUP1, Way.LOOKUP2, Way.LOOKUP3, Way.DRAFT))
    controller.draft_times = times
    with_rates(controller, {0: 0.6})
    choices = controller.plan([Candidate(0, 4, 100, [])], 1, 1, 0.0, budget=8).choices
    assert choices[0].way == Way.DRAFT
    assert choices[0].drafts >= 1
    for rows in (1, 2, 3) * SpeculationTuning().refit_every:  # the fit is reused until then
        times.observe(rows, 0.0018 + 0.00005 * rows)
    fixed, per_row = times.fit(1)
    assert fixed == pytest.approx(0.0018, rel=0.05)


@pytest.mark.parametrize("first", [0.05, 0.1, 0.3, 0.5, 0.7, 0.9])
def test_rows_are_priced_where_they_land(first: float) -> None:
    """A batch-1 step on a CPU whose products are padded to 4 rows: 1..4 rows cost the same,
    each row past them 4 ms. The first three drafts are free and later ones are not, which a
    single slope cannot say (it cost 12% of the goodput at a 0.1 acceptance). The fitted
    model smooths the kink a little, so the plan must reach the exhaustive optimum's goodput
    under the true clock within 1.5% (exactly it, unless two counts are that close)."""

    def clock(tokens: float) -> float:
        return 0.040 + 0.004 * max(tokens - 4, 0)

    controller = GoodputController((Way.EXTERNAL,), SpeculationTuning(hurdle=0.0))
    for _ in range(20):
        for tokens in range(1, 10):
            controller.observe_step(tokens, 1, 0.0, clock(tokens))
    with_rates(controller, {0: first}, follow=0.8)
    (choice,) = controller.plan([Candidate(0, 8, 0, [])], 1, 1, 0.0, budget=8).choices
    gains = gains_of(controller.acceptance, 0, Way.EXTERNAL, 8)
    goodputs = [(1 + gains[:d].sum()) / clock(1 + d) for d in range(9)]
    assert goodputs[choice.drafts] >= 0.985 * max(goodputs)
    assert choice.drafts >= 3  # the free rows are always taken


def test_no_drafts_when_rows_cost_more_than_they_return() -> None:
    # 16 sequences, every row as dear as a decode: a draft right 30% of the time adds 0.3
    # tokens for the price of one
    clock = FakeClock(0.0, 0.01, 0.0)
    controller = trained(clock)
    with_rates(controller, dict.fromkeys(range(16), 0.3))
    choices = controller.plan(candidates([4] * 16), 16, 16, 0.0, 1000).choices
    assert [c.drafts for c in choices] == [0] * 16


def test_every_slot_when_acceptance_is_one_and_rows_are_free() -> None:
    clock = FakeClock(0.05, 0.0, 0.001)
    controller = trained(clock)
    with_rates(controller, dict.fromkeys(range(8), 1.0))
    choices = controller.plan(candidates([4, 4, 3, 1, 4, 2, 4, 4]), 8, 8, 0.0, 1000).choices
    assert [c.drafts for c in choices] == [4, 4, 3, 1, 4, 2, 4, 4]


def test_the_budget_caps_the_drafts() -> None:
    controller = trained(FakeClock(0.05, 0.0, 0.001))
    with_rates(controller, dict.fromkeys(range(8), 1.0))
    choices = controller.plan(candidates([4] * 8), 8, 8, 0.0, 5).choices
    assert sum(c.drafts for c in choices) == 5


@pytest.mark.parametrize("seed", range(40))
def test_plan_is_the_exhaustive_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    clock = FakeClock(
        float(rng.uniform(0.001, 0.05)),
        float(rng.choice([0.0, 1e-4, 1e-3, 1e-2])),
        float(rng.choice([0.0, 1e-4, 1e-3])),
        float(rng.choice([0.0, 1e-6])),
    )
    controller = trained(clock)
    count = int(rng.integers(1, 5))
    rates = {i: float(rng.choice([0.0, 0.1, 0.5, 0.8, 0.95, 1.0])) for i in range(count)}
    with_rates(controller, rates, follow=float(rng.choice([0.2, 0.7, 1.0])))
    context = int(rng.integers(0, 2000))
    cands = candidates(rng.integers(0, 5, count).tolist(), context)
    base_tokens = count + int(rng.integers(0, 40))  # decodes plus some prefill
    base_pairs = float(base_tokens * context)
    choices = controller.plan(cands, base_tokens, count, base_pairs, 1000).choices
    assert all(0 <= c.drafts <= cand.slots for c, cand in zip(choices, cands, strict=True))
    plan = [(c.way, c.drafts) for c in choices]
    best = exhaustive(clock, controller, cands, base_tokens, base_pairs)
    assert goodput(clock, controller, plan, cands, base_tokens, base_pairs) == pytest.approx(
        best, rel=1e-6
    )


@pytest.mark.parametrize("seed", range(20))
def test_hybrid_plan_is_the_exhaustive_optimum(seed: int) -> None:
    """Lookup or draft model per sequence, the draft model's forwards shared: exact too."""
    rng = np.random.default_rng(100 + seed)
    controller = GoodputController((*LOOKUP_WAYS, DRAFT), SpeculationTuning(hurdle=0.0))
    fixed, per_token = float(rng.uniform(0.005, 0.03)), float(rng.choice([1e-4, 1e-3]))
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128):
        for seqs in (1, 4, 16):
            controller.observe_step(tokens * seqs, seqs, 0.0, fixed + per_token * tokens * seqs)
    per_forward, per_row = float(rng.uniform(0.0005, 0.005)), float(rng.choice([0, 1e-4]))
    for rows in (1, 2, 3, 5, 8):
        controller.observe_draft_forward(rows, per_forward + per_row * rows)
    count = int(rng.integers(1, 4))
    cands = []
    rates: dict[tuple[int, str], float] = {}
    for i in range(count):
        n = int(rng.integers(0, 4))
        lookup = rng.integers(0, 100, int(rng.integers(1, 4)) if n else 0).tolist()
        cands.append(Candidate(i, int(rng.integers(1, 4)), 0, lookup, n))
        for way in (*LOOKUP_WAYS, DRAFT):
            rates[(i, way)] = float(rng.choice([0.1, 0.5, 0.9]))
    follows = {way: float(rng.choice([0.3, 0.8, 1.0])) for way in (*LOOKUP_WAYS, DRAFT)}
    acceptance = controller.acceptance
    acceptance.firsts = lambda way, seq_ids: [rates[(i, way)] for i in seq_ids]  # type: ignore[method-assign]
    acceptance.follow_lists = lambda ways, count: [  # type: ignore[method-assign]
        [1.0] + [follows[way]] * (count - 1) for way in ways
    ]
    choices = controller.plan(cands, count, count, 0.0, 1000).choices

    def ratio(plan: list[tuple[str, int]]) -> float:
        tokens = count + sum(
            gains_of(controller.acceptance, i, way, d).sum() for i, (way, d) in enumerate(plan) if d
        )
        rows = sum(d for _, d in plan)
        depth = max([d for way, d in plan if way == DRAFT], default=0)
        draft_rows = sum(d for way, d in plan if way == DRAFT)
        seconds = fixed + per_token * (count + rows) + per_forward * depth + per_row * draft_rows
        return tokens / seconds

    options = []
    for c in cands:
        mine = [("none", 0)] + [(DRAFT, d) for d in range(1, c.slots + 1)]
        if c.lookup_n:
            way = LOOKUP_WAYS[min(c.lookup_n, 3) - 1]
            mine += [(way, d) for d in range(1, min(c.slots, len(c.lookup)) + 1)]
        options.append(mine)
    best = max(ratio(list(plan)) for plan in itertools.product(*options))
    chosen = [(c.way or "none", c.drafts) for c in choices]
    assert ratio(chosen) == pytest.approx(best, rel=1e-6)


def steps_until_drafting(controller: GoodputController, clock: FakeClock, steps: int) -> int:
    """Batch-1 steps planned and run on ``clock`` until a plan drafts other than by a probe
    (``steps``: none did)."""
    for step in range(steps):
        choice = controller.plan([Candidate(0, 8, 200, [])], 1, 1, 201.0, 1000).choices[0]
        tokens = 1 + choice.drafts
        pairs = float(_pairs(200, tokens))
        controller.observe_step(tokens, 1, pairs, clock(tokens, 1, pairs))
        if choice.drafts and controller.plans_since_probe:
            return step
    return steps


def test_a_drafted_shape_measured_slow_is_measured_again() -> None:
    """Batch 1, drafts that pay (rate 0.6, a row 3% of a step): after 64 drafted steps
    measured 4x slow (another process had the cores), every plan is plain, and plain steps
    never measure a drafted shape again. Every ``PROBE_EVERY`` plans one draft is added all
    the same; its steps are measured at their usual cost and drafting resumes in a bounded
    number of probes, where without probes it does not within 400 steps (not until the
    slow steps leave the step-time window)."""
    clock = FakeClock(0.015, 0.0004, 0.0, 1e-6)

    def poisoned(probe_every: int = PROBE_EVERY) -> GoodputController:
        controller = trained(clock, hurdle=HURDLE, probe_every=probe_every)
        with_rates(controller, {0: 0.6})
        for tokens in list(range(2, 10)) * 8:
            pairs = float(_pairs(200, tokens))
            controller.observe_step(tokens, 1, pairs, 4.0 * clock(tokens, 1, pairs))
        return controller

    probing = poisoned()
    assert probing.plan([Candidate(0, 8, 200, [])], 1, 1, 201.0, 1000).choices[0].drafts == 0
    assert steps_until_drafting(probing, clock, 400) <= 20 * PROBE_EVERY
    after = [
        probing.plan([Candidate(0, 8, 200, [])], 1, 1, 201.0, 1000).choices[0] for _ in range(3)
    ]
    assert all(choice.drafts for choice in after)  # planned, not a probe

    never = poisoned(probe_every=0)  # no probes
    assert steps_until_drafting(never, clock, 400) == 400


def test_steps_timed_with_half_the_cores_do_not_stall_drafting() -> None:
    """The stall above, with the slow steps timed (as the engine measures them on a CPU) at
    half the usual share of the cores: the steps of neighbouring shapes timed on a free
    machine outweigh them, and plans draft at once, no probe needed."""
    clock = FakeClock(0.015, 0.0004, 0.0, 1e-6)
    controller = trained(clock, hurdle=HURDLE, probe_every=0)
    with_rates(controller, {0: 0.6})
    for tokens in list(range(2, 10)) * 8:
        pairs = float(_pairs(200, tokens))
        controller.observe_step(tokens, 1, pairs, 4.0 * clock(tokens, 1, pairs), share=0.5)
    assert steps_until_drafting(controller, clock, 400) == 0


def spell(
    times: StepTimes, clock: FakeClock, shares: tuple[float, float], clean_after: bool = True
) -> None:
    """20 clean plain steps, then 8 of each drafted shape (2..9 tokens) timed 4x slow at
    ``shares[0]`` of the cores, then (``clean_after``) one of each timed clean at
    ``shares[1]``."""
    for _ in range(20):
        times.observe(1, 1, 200.0, clock(1, 1, 200.0))
    for tokens in list(range(2, 10)) * 8:
        pairs = float(_pairs(200, tokens))
        times.observe(tokens, 1, pairs, 4.0 * clock(tokens, 1, pairs), shares[0])
    for tokens in range(2, 10) if clean_after else ():
        pairs = float(_pairs(200, tokens))
        times.observe(tokens, 1, pairs, clock(tokens, 1, pairs), shares[1])


def test_a_step_timed_on_a_free_machine_outweighs_a_spells_steps() -> None:
    """Steps timed while another process had the cores (half the usual share of them, and 4x
    slow) inform a shape while nothing else is known there; one step of that shape timed at
    the usual share outweighs eight of them. Without shares (all 1.0: not measured) the
    spell's steps keep the shape at more than twice its cost."""
    clock = FakeClock(0.015, 0.0004, 0.0, 1e-6)
    pairs = float(_pairs(200, 5))
    during = StepTimes()
    spell(during, clock, (0.5, 1.0), clean_after=False)
    assert during.fit(5, 1).seconds(5, 1, pairs) > 3.0 * clock(5, 1, pairs)

    measured, unmeasured = StepTimes(), StepTimes()
    spell(measured, clock, (0.5, 1.0))
    spell(unmeasured, clock, (1.0, 1.0))
    assert measured.fit(5, 1).seconds(5, 1, pairs) == pytest.approx(clock(5, 1, pairs), rel=0.05)
    assert unmeasured.fit(5, 1).seconds(5, 1, pairs) > 2.0 * clock(5, 1, pairs)


@pytest.mark.parametrize("share", [0.5, 0.9, 2.0])
def test_lasting_contention_weighs_nothing_down(share: float) -> None:
    """When every step runs at about the same share of the cores (a loaded machine, one
    thread, or a server's other threads: the level, with a free machine's +-5% around it),
    the fits are those of unmeasured shares, exactly: the usual share is the machine's own
    (a bar fixed in absolute terms would weigh a loaded machine's steps by their noise)."""
    clock = FakeClock(0.015, 0.0004, 0.0005, 1e-6)
    rng = random.Random(0)
    plain, shared = StepTimes(), StepTimes()
    plain_draft, shared_draft = ForwardTimes(), ForwardTimes()
    for _ in range(100):
        seqs = rng.randint(1, 16)
        tokens = seqs + rng.randint(0, 3 * seqs)
        pairs = rng.uniform(0, 200) * tokens
        seconds = clock(tokens, seqs, pairs) * rng.uniform(0.9, 1.1)
        plain.observe(tokens, seqs, pairs, seconds)
        noisy = share * rng.uniform(0.95, 1.05)
        shared.observe(tokens, seqs, pairs, seconds, noisy)
        plain_draft.observe(seqs, seconds / 10)
        shared_draft.observe(seqs, seconds / 10, noisy)
    for tokens, seqs in [(1, 1), (4, 1), (8, 8), (40, 16)]:
        assert shared.fit(tokens, seqs) == plain.fit(tokens, seqs)
        assert shared_draft.fit(seqs) == plain_draft.fit(seqs)


def test_a_probe_adds_one_draft_that_acceptance_does_not_learn_from() -> None:
    """Every ``PROBE_EVERY`` plans: one draft more than the plan chose, within the budget,
    marked so that acceptance learns from the planned drafts only."""
    clock = FakeClock(0.015, 0.0004, 0.0, 1e-6)
    controller = trained(clock)
    with_rates(controller, {0: 0.6, 1: 0.05})
    cands = [Candidate(0, 8, 200, []), Candidate(1, 8, 200, [])]
    plans = [controller.plan(cands, 2, 2, 402.0, 1000).choices for _ in range(PROBE_EVERY)]
    for choices in plans[:-1]:
        assert all(c.planned is None and c.learned == c.drafts for c in choices)
    planned = [c.drafts for c in plans[0]]
    probed = plans[-1]
    assert sum(c.drafts for c in probed) == sum(planned) + 1
    extra = [i for i, c in enumerate(probed) if c.drafts != planned[i]]
    assert len(extra) == 1
    assert probed[extra[0]].learned == planned[extra[0]]
    # no room in the budget: no probe
    tight = trained(clock)
    with_rates(tight, {0: 0.6, 1: 0.05})
    for _ in range(PROBE_EVERY):
        last = tight.plan(cands, 2, 2, 402.0, sum(planned)).choices
    assert [c.drafts for c in last] == planned


@pytest.mark.parametrize("catch_up", [1, 2, 3, 40])
def test_a_probe_is_a_row_not_a_draft_models_catch_up(catch_up: int) -> None:
    """A plan of no drafts, a probe due, no lookup match: the draft model's first draft is
    the probe if its catch-up is a drafting sequence's usual one or two rows; past that (it
    sat out steps) there is none, and the probe stays due until a plan has a way to probe
    that is only a row (a lookup's draft)."""
    clock = FakeClock(0.015, 0.004, 0.0, 1e-6)  # a row: a quarter of a step
    controller = trained(clock, ways=(*LOOKUP_WAYS, DRAFT), probe_every=1)
    for rows in (1, 2, 3, 40):
        controller.observe_draft_forward(rows, 0.001 + 0.0002 * rows)
    with_rates(controller, {0: 0.05})  # no plan drafts
    choice = controller.plan([Candidate(0, 4, 200, [], catch_up=catch_up)], 1, 1, 200.0, 100)
    if catch_up <= 2:
        assert choice.choices[0] == Choice(DRAFT, 1, (0.05,), planned=0)
        assert controller.plans_since_probe == 0
        return
    assert choice.choices[0] == Choice(None, 0)
    assert controller.plans_since_probe == 1
    matched = Candidate(0, 4, 200, [5, 6], 2, catch_up=catch_up)
    choice = controller.plan([matched], 1, 1, 200.0, 100)
    assert choice.choices[0] == Choice(LOOKUP_WAYS[1], 1, (0.05,), planned=0)
    assert controller.plans_since_probe == 0


def pulled(outcomes: list[bool], decay: float, prior: float, weight: float) -> float:
    """The obvious estimate: decayed counts of ``outcomes`` (oldest first) pulled towards
    ``prior`` with ``weight`` pseudo-outcomes."""
    hits = sum(decay ** (len(outcomes) - 1 - i) * right for i, right in enumerate(outcomes))
    total = sum(decay**i for i in range(len(outcomes)))
    return (hits + weight * prior) / (total + weight)


def test_acceptance_is_per_position_and_decays() -> None:
    tuning = SpeculationTuning()
    model = AcceptanceModel(tuning)
    assert model.first(1, Way.LOOKUP2) == 0.5
    for _ in range(50):  # all or nothing: later drafts as likely as the first, given it
        model.observe(1, Way.LOOKUP2, 4, 4)
        model.observe(2, Way.LOOKUP2, 4, 0)
    population = pulled([True, False] * 50, tuning.shared_decay, 0.5, tuning.prior_weight)
    assert model.population(Way.LOOKUP2) == pytest.approx(population)
    for seq_id, right in ((1, True), (2, False)):
        own = pulled([right] * 50, tuning.sequence_decay, population, tuning.prior_weight)
        assert model.first(seq_id, Way.LOOKUP2) == pytest.approx(own)
    follow = pulled([True] * 50 * 3, tuning.shared_decay, 0.5, tuning.prior_weight)
    assert model.follow_rows((Way.LOOKUP2,), 4)[0][1:].min() == pytest.approx(follow, rel=0.05)
    # a new sequence starts from the population's rate
    assert model.first(3, Way.LOOKUP2) == pytest.approx(model.population(Way.LOOKUP2))
    # idle steps pull a sequence back towards the population, and make it a probe again
    before = model.first(2, Way.LOOKUP2)
    model.step += 100
    assert model.first(2, Way.LOOKUP2) > before
    model.forget(1)
    assert model.first(1, Way.LOOKUP2) == pytest.approx(model.population(Way.LOOKUP2))


def test_one_early_miss_does_not_keep_plans_at_one_draft() -> None:
    """A follow-on rate is learned only from verifies of two or more drafts. One miss at
    position 1 on a new engine (0.25 with its prior) made every later plan allot a single
    draft, so position 1 was never verified again: the draft model stayed at one draft a
    step at batch 1. Unrefreshed per-position rates drift back to their priors, and the
    plan allots a second draft again within a bounded number of steps."""
    controller = GoodputController((DRAFT,), SpeculationTuning(hurdle=0.0))
    for tokens in (1, 2, 3, 4, 5, 8):  # a row costs a 20th of a step, a draft forward a 10th
        controller.observe_step(tokens, 1, 0.0, 0.020 + 0.001 * (tokens - 1))
    controller.observe_draft_forward(1, 0.002)
    acceptance = controller.acceptance
    acceptance.firsts = lambda way, seq_ids: [0.6 for _ in seq_ids]  # type: ignore[method-assign]
    while acceptance.follow_rows((DRAFT,), 2)[0][1] > 0.3:  # the second draft was wrong
        acceptance.observe_made(DRAFT, 2, 2)
        acceptance.observe(0, DRAFT, 2, 1)
    drafts = []
    for _ in range(200):  # plans that allot one draft do not refresh position 1
        choice = controller.plan([Candidate(0, 8, 100, [])], 1, 1, 100.0, budget=8).choices[0]
        drafts.append(choice.drafts)
        acceptance.observe_made(DRAFT, choice.drafts, min(choice.drafts, 1))
    assert drafts[0] == 1
    assert max(drafts) >= 2
    assert drafts.index(max(drafts)) < 60


def test_a_way_that_missed_in_lockstep_is_tried_again() -> None:
    """Four sequences in lockstep missed their first draft-model drafts five times (the first
    answer token, which a draft model rarely gets right): the population's rate fell to
    ~0.22, under what a draft costs at batch 4, so no sequence drafted and nothing refreshed
    it (the draft model went unused for 100 steps at batch 4). Unrefreshed, it drifts back
    to its prior, and the plan drafts again within a bounded number of steps."""
    controller = GoodputController((DRAFT,), SpeculationTuning(hurdle=0.0))
    for tokens in (4, 5, 6, 8, 10, 12):  # a row costs a 10th of a sequence's share of a step
        controller.observe_step(tokens, 4, 0.0, 0.040 + 0.001 * (tokens - 4))
    controller.observe_draft_forward(4, 0.002)
    acceptance = controller.acceptance
    for _ in range(5):
        for seq_id in range(4):
            acceptance.observe(seq_id, DRAFT, 1, 0)
    assert acceptance.population(DRAFT) < 0.25
    drafting = []
    for _ in range(200):  # a plan without drafts refreshes nothing
        choices = controller.plan(
            [Candidate(i, 4, 100, []) for i in range(4)], 4, 4, 400.0, 16
        ).choices
        drafting.append(sum(c.drafts > 0 for c in choices))
    assert drafting[0] == 0
    assert max(drafting) == 4
    assert drafting.index(4) < 60


class FixedClock(StepClock):
    """A step clock that reads a given time, on a free machine."""

    def __init__(self, seconds: float) -> None:
        super().__init__(on_cpu=False)
        self.seconds = seconds

    def read(self) -> tuple[float, float]:
        return self.seconds, 1.0


def planned_step(
    speculator: Speculator, batch: list[Sequence], slots: int
) -> tuple[DraftPlan, list[ScheduledSequence], Proposal]:
    """A decode step of ``batch`` with ``slots`` reserved each, planned as the scheduler
    would (each sequence's slots cut to the plan's rows) and drafted."""
    out = SchedulerOutput([ScheduledSequence(seq, 1, slots) for seq in batch])
    plan = speculator.plan(out, 1000)
    for s in out.scheduled:
        s.num_lookahead = min(plan.rows(s.seq.seq_id), s.num_lookahead)
    return plan, out.scheduled, speculator.propose(plan, out.scheduled)


def learned(
    speculator: Speculator,
    plan: DraftPlan,
    scheduled: list[ScheduledSequence],
    proposal: Proposal,
    accepted: list[int],
    runs: list[TokenRun],
    seconds: float,
) -> None:
    """The step's verdict (``accepted`` drafts per sequence, its tokens already appended)
    and its time, learned as the engine would after the step."""
    result = VerifyResult(accepted, [[0] * (n + 1) for n in accepted])
    speculator.learn(plan, scheduled, proposal, result, [], runs, FixedClock(seconds))


# ------------------------------------------------------------------ re-probing


def run_copying_batch(switch: int, steps: int, seqs: int = 16) -> list[int]:
    """Drafting sequences per step of a fake engine whose target emits random tokens until
    step ``switch``, then copies its prompt; a row costs a 26th of a 16-sequence step, so a
    draft pays only when it is right more than ~60% of the time: while the text is copied."""
    rng = random.Random(1)
    # long enough that the copy does not wrap around (its end is followed by random text)
    prompt = [rng.randrange(1000, 2000) for _ in range(256)]
    batch = [
        Sequence(
            i, str(i), 0, list(prompt), SamplingParams(temperature=0.0, max_tokens=10_000), 0.0
        )
        for i in range(seqs)
    ]
    for seq in batch:
        seq.num_computed_tokens = seq.num_tokens - 1
    lookup = NgramProposer(1, 4)
    speculator = Speculator(lookup, GoodputController(LOOKUP_WAYS), None)  # type: ignore[arg-type]
    clock = FakeClock(0.01, 0.001, 0.0)
    drafting = []
    copied = {seq.seq_id: 0 for seq in batch}
    for step in range(steps):
        plan, scheduled, proposal = planned_step(speculator, batch, 4)
        drafting.append(sum(1 for s in scheduled if s.num_lookahead))
        runs, accepted_counts = [], []
        for seq, drafts in zip(batch, proposal.tokens, strict=True):
            runs.append(TokenRun([0] * (1 + len(drafts)), seq.num_computed_tokens, []))
            truth = []
            for _ in range(len(drafts) + 1):
                if step >= switch:
                    truth.append(prompt[copied[seq.seq_id] % len(prompt)])
                    copied[seq.seq_id] += 1
                else:
                    truth.append(rng.randrange(0, 1000))
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == truth[accepted]:
                accepted += 1
            if step >= switch:  # the copy position moves by what was emitted
                copied[seq.seq_id] -= len(drafts) - accepted
            seq.token_ids += truth[: accepted + 1]
            seq.num_computed_tokens = seq.num_tokens - 1
            accepted_counts.append(accepted)
        tokens = sum(len(r.token_ids) for r in runs)
        seconds = clock(tokens, len(batch)) + proposal.seconds
        learned(speculator, plan, scheduled, proposal, accepted_counts, runs, seconds)
    return drafting


def test_drafts_return_within_a_few_steps_once_the_text_is_copied() -> None:
    drafting = run_copying_batch(switch=60, steps=80)
    assert sum(drafting[20:60]) <= 0.05 * 16 * 40  # random text: (almost) no drafts
    assert min(drafting[70:80]) == 16  # copying: every sequence drafts again within 10 steps


def test_a_draft_models_backlog_is_charged_to_the_step_that_drafts_first() -> None:
    """A sequence the draft model has not seen must be caught up first, at the step that
    drafts it: 499 rows (0.05 s) outweigh what four drafts at 0.6 gain on a 0.02 s step, one
    row does not."""
    controller = GoodputController((DRAFT,))
    for tokens in (1, 2, 4, 8, 16, 64, 256):
        controller.observe_step(tokens, 1, 0.0, 0.02 + 0.0002 * tokens)
    for rows in (1, 2, 8, 64, 512):
        controller.observe_draft_forward(rows, 0.001 + 0.0001 * rows)
    with_rates(controller, {0: 0.6}, follow=0.6)
    unseen = Candidate(0, 4, 500, [], catch_up=500)
    caught_up = Candidate(0, 4, 500, [], catch_up=2)
    assert controller.plan([unseen], 1, 1, 500.0, 100).choices[0].drafts == 0
    assert controller.plan([caught_up], 1, 1, 500.0, 100).choices[0].drafts > 0


def test_a_backlog_costs_what_rows_cost_in_a_forward_of_its_size() -> None:
    """Near one row a draft forward is flat (memory-bound: its slope there is ~0), but 40
    catch-up rows cost 0.1 ms each: the backlog is charged at the slope of its own size."""
    controller = GoodputController((DRAFT,))
    for tokens in (1, 2, 4, 8, 16, 64, 256):
        controller.observe_step(tokens, 1, 0.0, 0.02 + 0.0002 * tokens)
    for rows in (1, 2, 3) * 4:
        controller.observe_draft_forward(rows, 0.002)
    for rows in (30, 40, 50) * 4:
        controller.observe_draft_forward(rows, 0.002 + 0.0001 * rows)
    with_rates(controller, {0: 0.5})
    behind = Candidate(0, 4, 100, [], catch_up=41)  # 40 rows beyond the step's own
    options = controller._options([behind], 1, 1)
    local = options.draft_fit[1]
    assert local < 0.00002
    first_row = options.prices.row_seconds(100) + local
    costs = options.costs
    assert costs[0, 0, 0] - first_row == pytest.approx(0.0001 * 40, rel=0.1)


def test_calibration_scales_a_ways_gains_and_recovers_when_unused() -> None:
    tuning = SpeculationTuning()
    model = AcceptanceModel(tuning)
    assert model.calibration(Way.DRAFT) == 1.0
    for _ in range(200):  # plans expected 1 accepted draft, half came
        model.calibrate(Way.DRAFT, 1.0, 0 if model.step % 2 else 1)
        model.step += 1
    # the sums keep shared_decay per verify and per step: about 1 / (1 - decay^2) drafts
    expected = 1 / (1 - tuning.shared_decay**2)
    factor = (0.5 * expected + tuning.prior_weight) / (expected + tuning.prior_weight)
    assert model.calibration(Way.DRAFT) == pytest.approx(factor, abs=0.05)
    model.step += 1000  # no plan used the way since: its factor is 1 again
    assert model.calibration(Way.DRAFT) == pytest.approx(1.0, abs=0.01)


def test_made_rates_follow_a_proposer_that_stops_early() -> None:
    model = AcceptanceModel()
    assert model.made_rows((Way.DRAFT,), 4)[0].tolist() == [
        1.0,
        1.0,
        1.0,
        1.0,
    ]  # until one stops early
    for _ in range(300):  # allotted 4, the proposer stops after 2
        model.observe_made(Way.DRAFT, 4, 2)
    made = model.made_rows((Way.DRAFT,), 4)[0]
    assert made[:2].tolist() == [1.0, 1.0]
    tuning = model.tuning
    assert made[2] == pytest.approx(
        pulled([False] * 300, tuning.shared_decay, 1.0, tuning.prior_weight)
    )
    assert made[3] <= made[2]
    for _ in range(300):  # now it makes the third half of the time
        model.observe_made(Way.DRAFT, 4, 2)
        model.observe_made(Way.DRAFT, 4, 3)
    assert model.made_rows((Way.DRAFT,), 4)[0][2] == pytest.approx(0.5, abs=0.05)
    for _ in range(300):  # a priced first draft: dropped half the time, the rest as before
        model.observe_made(Way.DRAFT, 4, 0)
        model.observe_made(Way.DRAFT, 4, 3)
    made = model.made_rows((Way.DRAFT,), 4)[0]
    assert made[0] == pytest.approx(0.5, abs=0.05)
    assert made[2] == pytest.approx(0.5, abs=0.05)  # given the first: always the second


@pytest.mark.parametrize("seed", range(20))
def test_a_plan_counts_only_the_drafts_a_proposer_makes(seed: int) -> None:
    """A draft model with a confidence stop makes draft j only with chance made_j: a draft
    it does not make costs no forward and no row, except the first, whose forward runs
    whenever one is allotted (a priced first draft is dropped after it, in odd seeds). At
    batch 1 the plan must be the exact optimum of expected tokens over expected seconds."""
    rng = np.random.default_rng(200 + seed)
    controller = GoodputController((DRAFT,), SpeculationTuning(hurdle=0.0))
    fixed, per_token = float(rng.uniform(0.005, 0.03)), float(rng.choice([1e-5, 1e-4, 1e-3]))
    for tokens in (1, 2, 4, 8, 16, 32):
        controller.observe_step(tokens, 1, 0.0, fixed + per_token * tokens)
    per_forward = float(rng.uniform(0.1, 0.5)) * fixed
    for rows in (1, 2, 3):
        controller.observe_draft_forward(rows, per_forward)
    first, follow = float(rng.uniform(0.1, 0.6)), float(rng.uniform(0.3, 0.9))
    with_rates(controller, {0: first}, follow=follow)
    going_on = float(rng.uniform(0.1, 0.9))  # the proposer goes on past a draft this often
    dropped = float(rng.uniform(0.2, 0.7)) if seed % 2 else 0.0  # a first draft not made
    slots = 6
    for _ in range(500):
        made = 1
        while made < slots and rng.random() < going_on:
            made += 1
        controller.observe_made(DRAFT, slots, 0 if rng.random() < dropped else made)
    planned = controller.plan([Candidate(0, slots, 0, [])], 1, 1, 0.0, 100)
    choice = planned.choices[0]
    made = controller.acceptance.made_rows((DRAFT,), slots)[0]  # as the plan saw them (its step)
    assert made[0] == pytest.approx(1 - dropped, abs=0.1)
    gains = gains_of(controller.acceptance, 0, DRAFT, slots)

    def ratio(count: int) -> float:
        tokens = 1 + float((made[:count] * gains[:count]).sum())
        seconds = fixed + per_token * (1 + float(made[:count].sum()))
        forwards = float(count > 0) + float(made[1:count].sum())
        return tokens / (seconds + per_forward * forwards)

    assert ratio(choice.drafts) == pytest.approx(max(ratio(n) for n in range(slots + 1)), 1e-6)
    # the choice is the same whatever made is (gain and cost carry the same factor); what the
    # plan expects of it is not: its goodput over the plain step's
    assert planned.report.expected_gain == pytest.approx(
        ratio(choice.drafts) * (fixed + per_token), rel=1e-5
    )
    # what the plan expects of the drafts made, for calibration: not weighted by made
    assert choice.expected == pytest.approx(np.cumsum(gains)[: choice.drafts].tolist())


def test_calibration_settles_at_the_true_bias() -> None:
    """Estimates twice the truth: the factor goes to 0.5 (against calibrated expectations it
    would settle at the square root, 0.71)."""
    controller = GoodputController((Way.EXTERNAL,), SpeculationTuning(hurdle=0.0))
    for tokens in (1, 2, 4, 8):
        controller.observe_step(tokens, 1, 0.0, 0.01 + 1e-6 * tokens)
    with_rates(controller, {0: 0.8}, follow=0.0)  # one draft is all that may be right
    rng = random.Random(0)
    for _ in range(3000):
        choice = controller.plan([Candidate(0, 1, 0, [])], 1, 1, 0.0, 10).choices[0]
        assert choice.drafts == 1
        controller.observe_verify(0, Way.EXTERNAL, 1, int(rng.random() < 0.4), choice.expected[0])
    tuning = controller.tuning  # decayed sums of 0.8 expected a draft, with the prior's weight
    expected = 0.8 / (1 - tuning.shared_decay**2)
    factor = (0.5 * expected + tuning.prior_weight) / (expected + tuning.prior_weight)
    assert controller.acceptance.calibration(Way.EXTERNAL) == pytest.approx(factor, abs=0.05)


@pytest.mark.parametrize("seed", range(10))
def test_the_price_of_a_row_is_the_plans_goodput_times_its_seconds(seed: int) -> None:
    """What a draft-model sibling must beat (``Prices.row_tokens``): the plan's goodput is the
    true expected goodput of the chosen plan, and one more row's seconds are the clock's."""
    rng = np.random.default_rng(100 + seed)
    clock = FakeClock(float(rng.uniform(0.005, 0.05)), float(rng.choice([1e-4, 1e-3])), 1e-4, 1e-6)
    controller = trained(clock)
    seqs = int(rng.integers(1, 5))
    with_rates(controller, {i: float(rng.uniform(0.2, 0.9)) for i in range(seqs)})
    cands = candidates([4] * seqs, context=int(rng.integers(0, 300)))
    base_pairs = float(sum(c.context + 1 for c in cands))
    planned = controller.plan(cands, seqs, seqs, base_pairs, 1000)
    plan = [(c.way, c.drafts) for c in planned.choices]
    true = goodput(clock, controller, plan, cands, seqs, base_pairs)
    assert planned.prices.tokens_per_second == pytest.approx(true, rel=1e-3)
    context = cands[0].context
    assert planned.prices.row_seconds(context) == pytest.approx(
        clock.per_token + clock.per_pair * context, rel=1e-3, abs=1e-7
    )


def test_rows_at_batch_8_are_priced_at_the_slope_of_the_steps_drafts_make() -> None:
    """Batch 8 with 8 slots each, on a clock flat to 16 tokens (memory-bound) and 3 ms a
    token past it: a row is priced at the slope around the step with half the slots drafted
    (40 tokens), where the drafts a plan weighs land, not at a 12-token step (8 plus half of
    one sequence's slots), where rows are free and every slot looked worth drafting."""

    def clock(tokens: float, pairs: float) -> float:
        return 0.05 + 0.003 * max(tokens - 16, 0.0) + 1e-7 * pairs

    controller = GoodputController((DRAFT,), SpeculationTuning(hurdle=0.0))
    rng = np.random.default_rng(0)
    for step in range(120):
        tokens = int(rng.choice([8, 8, 8, 9, 10, 12, 16, 24, 40, 72]))
        pairs = tokens * (100 + step)
        controller.observe_step(tokens, 8, pairs, clock(tokens, pairs))
    planned = controller.plan(candidates([8] * 8, context=200), 8, 8, 8 * 200, 1000)
    assert planned.prices.row_seconds(200) == pytest.approx(0.003 + 1e-7 * 200, rel=0.25)


@pytest.mark.parametrize("seed", range(60))
def test_depths_skipped_are_those_no_plan_of_that_depth_beats(seed: int) -> None:
    """The one-pass test that spares a solve per depth against brute force: a depth is kept
    exactly when some choice of one prefix (or none) per candidate, the draft model's below
    the depth, has a goodput above the floor."""
    rng = np.random.default_rng(seed)
    count, ways, positions = (int(rng.integers(1, n)) for n in (4, 4, 5))
    draft = None if rng.random() < 0.3 else int(rng.integers(0, ways))
    usable = rng.integers(0, positions + 1, (count, ways))
    valid = np.arange(positions)[None, None, :] < usable[:, :, None]
    # many drafts worth little, so that a longer prefix is often worth less than a shorter
    cum_gains = np.cumsum(rng.uniform(0, 1, (count, ways, positions)) ** 3, axis=2)
    cum_costs = np.cumsum(rng.uniform(0, 0.004, (count, ways, positions)), axis=2)
    depths = positions + 1 if draft is not None else 1
    bases = 0.02 + np.cumsum(np.r_[0.0, rng.uniform(0, 0.003, depths - 1)])
    floor = count / bases[0] * float(rng.uniform(1.0, 1.6))
    promising = promising_depths(cum_gains, cum_costs, valid, draft, bases, count, floor)
    for depth in range(depths):
        per_candidate = []
        for i in range(count):
            mine = [(0.0, 0.0)]
            for w in range(ways):
                for j in range(positions):
                    if valid[i, w, j] and (w != draft or j < depth):
                        mine.append((cum_gains[i, w, j], cum_costs[i, w, j]))
            per_candidate.append(mine)
        beaten = any(
            (count + sum(g for g, _ in plan)) / (bases[depth] + sum(c for _, c in plan)) > floor
            for plan in itertools.product(*per_candidate)
        )
        assert promising[depth] == beaten, depth


@pytest.mark.parametrize("seed", range(10))
def test_position_rates_are_one_timed_rate_per_position(seed: int) -> None:
    """The per-position lists a plan reads against one ``_TimedRate`` object per position
    (the obvious form), over random outcomes, idle steps and reads past what was seen."""
    rng = random.Random(seed)
    fast, slow = _PositionRates(0.97), []
    step = 0
    for _ in range(100):
        step += rng.choice([0, 1, 1, 5])
        start, stop = rng.randint(0, 3), rng.randint(0, 7)
        right_below, decay = rng.randint(0, 7), rng.choice([0.9, 0.99])
        fast.observe(start, stop, right_below, decay, step)
        while len(slow) < stop:
            slow.append(_TimedRate(DecayedRate(), step, 0.97))
        for position in range(start, stop):
            slow[position].observe(position < right_below, decay, step)
        count = rng.randint(0, 9)
        want = [slow[j].value(0.5, 1.0, step + 3) if j < len(slow) else 0.5 for j in range(count)]
        assert fast.values(count, 0.5, 1.0, step + 3) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("right_past_two", [True, False])
def test_positions_past_the_plans_drafts_are_learned_from_the_lookups_rest(
    right_past_two: bool,
) -> None:
    """A batch-1 sequence copies its prompt, and rows past a step of 3 tokens cost a step
    each, so plans draft 2 by lookup and never deeper. Nothing verifies draft 3, but when
    both drafts were right the target's next token is what a verify of it would have been
    compared with: position 2's follow-on outcomes are learned from the lookup's rest (right
    when the text goes on copying, wrong when it leaves the prompt there), where without it
    the position would have none and sit at its prior for good."""
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 2000) for _ in range(1000)]
    seq = Sequence(0, "0", 0, list(prompt), SamplingParams(temperature=0.0, max_tokens=10**4), 0.0)
    seq.token_ids += prompt[:8]  # the copy has begun: a lookup matches
    seq.num_computed_tokens = seq.num_tokens - 1
    controller = GoodputController(LOOKUP_WAYS)
    speculator = Speculator(NgramProposer(1, 4), controller, None)  # type: ignore[arg-type]

    def seconds(tokens: int) -> float:
        return 0.02 if tokens <= 3 else 0.02 * (tokens - 2)

    for tokens in list(range(1, 10)) * 3:  # steps of every size timed
        controller.observe_step(tokens, 1, 0.0, seconds(tokens))
    copied = 8
    planned: list[int] = []
    for _ in range(60):
        plan, scheduled, proposal = planned_step(speculator, [seq], 8)
        drafts = proposal.tokens[0]
        run = TokenRun([0] * (1 + len(drafts)), seq.num_computed_tokens, [])
        planned.append(len(drafts))
        truth = prompt[copied : copied + len(drafts) + 1]
        if not right_past_two and len(drafts) == 2:
            truth[2] = 7  # the text leaves the prompt for a token right after the drafts
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == truth[accepted]:
            accepted += 1
        seq.token_ids += truth[: accepted + 1]
        copied += accepted + 1
        seq.num_computed_tokens = seq.num_tokens - 1
        tokens = 1 + len(drafts)
        step_seconds = seconds(tokens) + proposal.seconds
        learned(speculator, plan, scheduled, proposal, [accepted], [run], step_seconds)
    assert planned.count(2) > 40  # the plans' depth
    # the outcomes at position 2 (decayed counts), over the lookup ways the plans used
    rates = controller.acceptance._follow.values()
    judged = sum(rate.total[2] for rate in rates if len(rate.total) > 2)
    right = sum(rate.hits[2] for rate in rates if len(rate.hits) > 2)
    assert judged > 2.0
    assert right == pytest.approx(judged if right_past_two else 0.0)
