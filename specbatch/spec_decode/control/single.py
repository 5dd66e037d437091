"""One sequence's plan in plain floats: the plan of a batch-1 step, made every step.

The controller plans over arrays of candidates x ways x draft positions
(``GoodputController._plan_arrays``). For one candidate they hold a few dozen numbers, and each
numpy call costs more than its arithmetic: 0.54 ms a plan, ~5% of a gguf batch-1 step, paid
on every step, drafting or not. Here is the same plan for a step whose
forward is one sequence's: the same quantities, by the same operations in the same order, so
the same bits (a test compares the two on random models and candidates; the arrays path stays
the reference and the path for more candidates). The quantities are documented there:
``_options`` (a draft's chance of being emitted, the seconds it adds), ``_solve`` (the best
goodput, here over one way's prefix in one pass: a draft-model chain at the forwards it runs),
``_probed``. This is the one routine of a one-candidate plan; the arrays path solves any
number of candidates alike.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specbatch.spec_decode.control.choices import (
    DRAFT,
    FORCED,
    Candidate,
    Choice,
    ControllerPlan,
    Prices,
    Way,
    probe_free,
    report_of,
)
from specbatch.spec_decode.control.solver import EPSILON

if TYPE_CHECKING:
    from specbatch.spec_decode.control.controller import GoodputController


@dataclass(frozen=True)
class _Option:
    """One way's drafts for the candidate, by position (``_Options``' row for it, its usable
    positions only: as many as may be drafted)."""

    gains: list[float]
    costs: list[float]
    uncalibrated: list[float]
    ran: list[float]


def plan_one(
    controller: GoodputController,
    candidate: Candidate,
    base_tokens: int,
    base_pairs: float,
    budget: int,
    probe_next: bool,
) -> tuple[ControllerPlan, bool | None]:
    """``controller.plan([candidate], base_tokens, 1, base_pairs, budget)`` once its step
    times are measured (``plan`` has counted the step), a probe due if ``probe_next`` and
    the plan leaves room; and whether it was given one (None: it left no room)."""
    ways = (*controller.ways, FORCED) if candidate.forced else controller.ways
    most = candidate.slots
    context = float(candidate.context)
    step, per_pair, base_fit = controller.batch_one_rows(base_tokens, base_pairs, context, 1, most)
    # the row's price at the candidate's own context, the mean's: no per-pair offset
    row = step
    draft_fit = controller.draft_times.fit(1) if DRAFT in ways else (0.0, 0.0)
    per_way = _ways(controller, candidate, ways, row, draft_fit)
    base = base_fit.seconds(base_tokens, 1, base_pairs)
    draft = controller.ways.index(DRAFT) if DRAFT in controller.ways else None
    floor = 1 / base * (1 + controller.tuning.hurdle)
    way, last, ratio = _best(per_way, draft, base, draft_fit[0], floor)
    expected_gain = ratio * base if last >= 0 else 1.0  # (the plain plan's is 1, not its rounding)
    last = min(last, max(budget, 0) - 1)  # ``within_budget``, for one candidate
    planned = way, last
    probe = None
    if last + 1 < budget:
        probe = False
        if probe_next:
            way, last = _probed(per_way, draft, draft_fit[0], planned, ratio, candidate)
            probe = (way, last) != planned
    choice = Choice(None, 0)
    if last >= 0:
        expected = itertools.accumulate(per_way[way].uncalibrated[: last + 1])
        learned = None if planned == (way, last) else planned[1] + 1
        choice = Choice(ways[way], last + 1, tuple(expected), learned)
    prices = Prices(float(step[0]), float(per_pair[0]), context, ratio)
    report = report_of([candidate], [choice], base, prices, expected_gain)
    return ControllerPlan([choice], prices, report), probe


def _ways(
    controller: GoodputController,
    candidate: Candidate,
    ways: tuple[Way, ...],
    row: list[float],
    draft_fit: tuple[float, float],
) -> list[_Option]:
    """Per way, its drafts' chances and seconds (``_Options`` for one candidate)."""
    acceptance = controller.acceptance
    proposing = controller.proposing_seconds(ways, draft_fit)
    out = []
    for way, extra in zip(ways, proposing, strict=True):
        copies = candidate.copied(way)
        usable = candidate.slots if copies is None else min(candidate.slots, len(copies))
        if not usable:  # (a lookup without a match): no position is read
            out.append(_Option([], [], [], []))
            continue
        follow = acceptance.follow_lists((way,), usable)[0]
        made = acceptance.made_lists((way,), usable)[0]
        first = acceptance.firsts(way, (candidate.seq_id,))[0]
        calibration = acceptance.calibration(way)
        ran = [1.0, *made[1:]]
        gains, costs, uncalibrated = [], [], []
        chance = 1.0
        for j in range(usable):
            chance *= follow[j]
            accepted = first * chance
            uncalibrated.append(accepted)
            gains.append(min(calibration * accepted, 1.0) * made[j])
            costs.append(row[j] * made[j] + extra * ran[j])
        if way == DRAFT:  # its backlog, beyond the row a step costs anyway
            catch_up = max(float(candidate.catch_up), 1.0)
            per_row = draft_fit[1] if catch_up <= 1 else controller.draft_times.fit(catch_up)[1]
            costs[0] += per_row * (catch_up - 1.0)
        out.append(_Option(gains, costs, uncalibrated, ran))
    return out


def _best(
    per_way: list[_Option], draft: int | None, base: float, per_forward: float, floor: float
) -> tuple[int, int, float]:
    """The (way, last draft index, goodput) of the best prefix of one way, if its goodput
    clears ``floor`` (else way 0, index -1 and the plain step's goodput): a draft-model chain
    of j + 1 drafts pays the forwards it runs (each one whenever the draft before it was
    made, the first whenever one is allotted), any other way's none."""
    forwards = [0.0]
    if draft is not None:
        for ran in per_way[draft].ran:  # (the arrays path's 1 - (1 - ran) ** sequences)
            forwards.append(forwards[-1] + (1.0 - (1.0 - ran)))
    best, way, last = -math.inf, 0, -1
    for w, option in enumerate(per_way):
        gains = costs = 0.0
        for j in range(len(option.gains)):
            gains += option.gains[j]
            costs += option.costs[j]
            depth = j + 1 if w == draft else 0
            ratio = (1 + gains) / (base + per_forward * forwards[depth] + costs)
            if ratio > best:
                best, way, last = ratio, w, j
    if best <= floor * (1 + EPSILON):
        return 0, -1, 1 / base
    return way, last, best


def _probed(
    per_way: list[_Option],
    draft: int | None,
    per_forward: float,
    chosen: tuple[int, int],
    ratio: float,
    candidate: Candidate,
) -> tuple[int, int]:
    """``chosen`` with the one draft more that costs the plan least (``_probed``)."""
    w, d = chosen
    depth = d + 1 if w == draft and d >= 0 else 0
    best, probe = -math.inf, None
    j = d + 1
    for way in range(len(per_way)) if d < 0 else (w,):
        option = per_way[way]
        if j >= len(option.gains) or not probe_free(way == draft, j, candidate.catch_up):
            continue
        cost = option.costs[j]
        if way == draft and j + 1 > depth:  # one more draft-model forward
            cost += per_forward
        value = option.gains[j] - ratio * cost
        if value > best:
            best, probe = value, (way, j)
    return chosen if probe is None else probe
