"""The goodput controller: each step, how many drafts each sequence gets, and which way.

A draft is worth the chance that it is emitted (it and every draft before it accepted) and
costs the time it adds to the step: a row in the target's forward (nearly free at batch 1 on a
CPU, as dear as a decode row at batch 64, dearer with a long context) and its proposer's time (a
prompt lookup is free; a draft model pays a forward per draft position and a row per draft,
the first being the catch-up on the tokens it has not seen: the backlog beyond one row, a new
sequence's whole prompt or the tokens of the steps it was skipped, is charged in full to the
step that drafts first). The controller
chooses, per sequence, a way (a prompt-lookup match, graded by its length; the draft model; an
application's proposer) and a count 0..slots to maximise the whole step's expected tokens per
second::

    (sequences + sum of emitted-draft chances) / (step time + added rows + proposer time)

No draft at all is always a candidate and wins when nothing beats it, so a step is never
planned slower per token than speculation off. The maximum of that ratio is found exactly
(Dinkelbach's method: for a trial ratio ``r`` each sequence independently takes the prefix of
drafts maximising ``sum(gain - r * cost)``; the ratio of that choice is the next ``r`` until it
stops rising), once per possible depth of the draft model's forwards, whose fixed cost is
shared by every sequence drafting that deep; one pass over every depth first finds those at
which no plan can beat the plain step's goodput raised by the hurdle, whose solves are skipped
(most steps' every depth, at batches where drafting seldom pays).

Times come from :mod:`step_times` (measured as the engine runs), chances from
:mod:`acceptance` (measured from verifies, and for prompt lookup also from steps where the
lookup was not used: what it would have drafted is compared with what the target emitted, which
judges a point-mass draft exactly as a verify would). A step whose plain shape was never
timed (a new batch size) runs plain, so that drafts are weighed against its measured time, not
an extrapolation from other shapes; until the step-time model has a few steps it drafts every
slot, so that it sees what drafts cost. The step-time model learns a
drafted step's shape only from drafted steps, so every ``probe_every`` plans one draft more
than the plan chose is run (the exception to "never planned slower": one row in so many
steps), and a shape measured slow once is measured again. A probe is that row, not a draft
model's catch-up: a draft model's first draft is no probe where it would first compute the
tokens of steps it sat out (``probe_free``; at batch 1 on a gguf step such a probe cost 15 ms,
the writing prompts' 3% against speculation off). The constants are fields of
:class:`~specbatch.spec_decode.tuning.SpeculationTuning`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from specbatch.spec_decode.control import single
from specbatch.spec_decode.control.acceptance import AcceptanceModel
from specbatch.spec_decode.control.choices import (
    DRAFT,
    EXTERNAL,
    FORCED,
    Candidate,
    Choice,
    ControllerPlan,
    PlanReport,
    Prices,
    Way,
    probe_free,
    report_of,
)
from specbatch.spec_decode.control.solver import (
    all_slots,
    best_by_depth,
    within_budget,
)
from specbatch.spec_decode.control.step_times import ForwardTimes, StepCost, StepTimes
from specbatch.spec_decode.tuning import SpeculationTuning


class GoodputController:
    """Chooses each step's drafts; learns step times and acceptance from the engine."""

    def __init__(self, ways: tuple[Way, ...], tuning: SpeculationTuning | None = None) -> None:
        self.ways = ways  # the proposer's (a constraint's forced tokens join per plan)
        self.tuning = tuning = tuning or SpeculationTuning()
        self.times = StepTimes(tuning)
        self.draft_times = ForwardTimes(tuning)  # a draft model's forwards, by rows
        self._external = (0.0, 0.0)  # an application's proposer: decayed seconds and drafts
        self.acceptance = AcceptanceModel(tuning)
        self.plans_since_probe = 0  # see ``SpeculationTuning.probe_every``

    def plan(
        self,
        candidates: list[Candidate],
        base_tokens: int,
        base_seqs: int,
        base_pairs: float,
        budget: int,
    ) -> ControllerPlan:
        """The drafts of each candidate for a step whose forward has ``base_tokens`` tokens of
        ``base_seqs`` sequences attending ``base_pairs`` (row, key) pairs before drafts, with
        at most ``budget`` draft rows in all."""
        self.acceptance.step += 1
        # no drafts either where the plain step's shape was never timed (a new batch size):
        # what every draft is weighed against is measured first, by running it
        if (
            not candidates
            or not max(c.slots for c in candidates)
            or not self.times.timed_near(base_tokens, base_seqs)
        ):
            nothing = [Choice(None, 0) for _ in candidates]
            return ControllerPlan(nothing, report=PlanReport(candidates=len(candidates)))
        if len(candidates) == 1 and base_seqs == 1 and self.times.ready:
            planned, probe = single.plan_one(
                self, candidates[0], base_tokens, base_pairs, budget, self._probe_next()
            )
            self._count_plan(probe)
            return planned
        return self._plan_arrays(candidates, base_tokens, base_seqs, base_pairs, budget)

    def _plan_arrays(
        self,
        candidates: list[Candidate],
        base_tokens: int,
        base_seqs: int,
        base_pairs: float,
        budget: int,
    ) -> ControllerPlan:
        """``plan`` over arrays of candidates x ways x draft positions (a batch-1 step's plan
        is :func:`single.plan_one`'s: the same in plain floats, and this its reference)."""
        if self.times.ready:  # drafts within the measured shapes (``StepTimes.reach``)
            reach = int(self.times.reach(base_seqs)) - base_tokens
            budget = min(budget, max(reach, 0))
        if self.times.ready and base_seqs > 1:
            plain = self._plain_unless_a_draft_pays(candidates, base_tokens, base_seqs, base_pairs)
            due = budget > 0 and self._probe_next() and self._probe_lands(candidates)
            if plain is not None and not due:
                self._count_plan(False if budget > 0 else None)
                return plain
        options = self._options(candidates, base_tokens, base_seqs, base_pairs)
        gains, costs, valid = options.gains, options.costs, options.valid
        expected_gain, ratio = 1.0, 0.0
        base = options.base_cost.seconds(base_tokens, base_seqs, base_pairs)
        if not self.times.ready:  # measure what drafts cost: every slot, the likeliest way
            chosen = all_slots(gains, valid)
        else:
            chosen, ratio = self._solve(options, len(candidates), base)
            if any(d >= 0 for _, d in chosen):  # (the plain plan's is 1, not its rounding)
                expected_gain = ratio * base / len(candidates)
        planned = chosen = within_budget(chosen, gains, costs, max(budget, 0))
        if self.times.ready:
            probe: bool | None = None  # (a plan without room is no plan towards a probe)
            if sum(d + 1 for _, d in chosen) < budget:
                probe = False
                if self._probe_next():
                    catch_ups = [c.catch_up for c in candidates]
                    chosen = self._probed(chosen, options, ratio, catch_ups)
                    probe = chosen != planned
            self._count_plan(probe)
        expected = np.cumsum(options.uncalibrated, axis=2)
        choices = [
            Choice(
                options.ways[w],
                d + 1,
                tuple(expected[i, w, : d + 1].tolist()),
                None if was == (w, d) else was[1] + 1,
            )
            if d >= 0
            else Choice(None, 0)
            for i, ((w, d), was) in enumerate(zip(chosen, planned, strict=True))
        ]
        p = options.prices
        prices = Prices(p.step, p.per_pair, p.mean_context, ratio)
        report = report_of(candidates, choices, base, prices, expected_gain)
        return ControllerPlan(choices, prices, report)

    def _probe_next(self) -> bool:
        """Whether the next plan leaving room in its budget gets a probe (one draft more
        every ``probe_every`` such plans, see the module docstring)."""
        every = self.tuning.probe_every
        return bool(every) and self.plans_since_probe + 1 >= every

    def _probe_lands(self, candidates: list[Candidate]) -> bool:
        """Whether a probe could land on any candidate (``_probed``'s first drafts: a way
        that copies something for it, or one that drafts its own and, for the draft model,
        ``probe_free``): where none could, a due probe waits without building the plan's
        arrays (at batch 64 in the gguf mode, every lookup beyond reach and the draft model
        sat out, each plan built them to find no probe: 0.7 ms of a 78 ms step)."""
        makers = [way for way in self.ways if not way.copies]
        for candidate in candidates:
            if not candidate.slots:
                continue
            if candidate.copies():
                return True
            if any(probe_free(way == DRAFT, 0, candidate.catch_up) for way in makers):
                return True
        return False

    def _count_plan(self, probe: bool | None) -> None:
        """Count a plan towards the next probe: ``probe`` None where it left no room in its
        budget (not counted), else whether it was given one (the count starts again)."""
        if probe:
            self.plans_since_probe = 0
        elif probe is not None:
            self.plans_since_probe += 1

    def _plain_unless_a_draft_pays(
        self, candidates: list[Candidate], base_tokens: int, base_seqs: int, base_pairs: float
    ) -> ControllerPlan | None:
        """The plain step's plan if no draft of any candidate can raise the step's goodput
        above the hurdle, else None (plan it in full): the exact plan's answer at a few
        floats per candidate, way and position, where building its arrays took ~1 ms a step
        at batch 32 (the most of speculation's host time on steps that draft nothing: 3% of
        a gguf step there, where a row costs what a decode does and no draft pays).

        A plan beats the floor (the plain step's goodput raised by the hurdle) only where its
        drafts' gains exceed the floor times their seconds by more than the plain step falls
        short of it: ``sum(gain - floor * cost) > floor * (base + draft forwards) - count``
        (``solver.promising_depths``, the exact test). Each draft's term is at most its chance
        (the first draft's, calibrated, times the follow-on chances to its position; at most
        1) less the floor times its first position's row and its proposer's seconds per draft
        (later rows attend more keys, a catch-up only adds, a proposer that stops early
        saves its gain with its cost), and a plan with the draft model runs one draft forward
        at least. So no draft pays where the candidates' best sums of positive terms fit in
        that slack, without the draft model and with one forward of it: at batch 8 in the
        gguf mode the draft model's first chance beat a first row on every step, and only its
        forward's fixed seconds showed it could not pay."""
        contexts = [c.context for c in candidates]
        most = max(c.slots for c in candidates)
        worth, base, prices = self._first_rows(contexts, most, base_tokens, base_seqs, base_pairs)
        count = len(candidates)
        floor = prices.tokens_per_second * (1 + self.tuning.hurdle) * (1 - 1e-9)
        open_ = [i for i, tokens in enumerate(worth) if tokens < 1.0]  # (no chance exceeds 1)
        ways = (*self.ways, FORCED) if any(candidates[i].forced for i in open_) else self.ways
        draft_fit = self.draft_times.fit(count) if DRAFT in ways else (0.0, 0.0)
        others, drafting = [0.0] * count, [0.0] * count  # best sums: other ways, the draft's
        acceptance = self.acceptance
        copying: dict[Way, dict[int, int]] = {}  # per way that copies: drafts it may make
        for i in open_:
            candidate = candidates[i]
            for way, copy in candidate.copies():
                copying.setdefault(way, {})[i] = min(candidate.slots, len(copy))
        slots = {i: candidates[i].slots for i in open_}  # a way that drafts its own: every slot
        follows = acceptance.follow_lists(ways, most)
        proposing = self.proposing_seconds(ways, draft_fit)
        for way, seconds, follow in zip(ways, proposing, follows, strict=True):
            drafts_of = copying.get(way, {}) if way.copies else slots
            if not drafts_of:
                continue
            calibration = acceptance.calibration(way)
            best = drafting if way == DRAFT else others
            firsts = acceptance.firsts(way, [candidates[i].seq_id for i in drafts_of])
            for (i, drafts), first in zip(drafts_of.items(), firsts, strict=True):
                price, chance, value = worth[i] + floor * seconds, calibration * first, 0.0
                for j in range(drafts):
                    chance *= follow[j]  # (follow[0] is 1)
                    term = min(chance, 1.0) - price
                    if term <= 0.0:  # (later terms are no larger)
                        break
                    value += term
                best[i] = max(best[i], value)
        short = base * floor - count  # what the plain step falls short of the floor by
        # (the hair of promising_depths: rounding never answers plain where it would plan)
        if sum(others) > short * (1 - 1e-9):
            return None
        with_draft = (base + draft_fit[0]) * floor - count
        if DRAFT in ways and sum(map(max, others, drafting)) > with_draft * (1 - 1e-9):
            return None
        nothing = [Choice(None, 0) for _ in candidates]
        return ControllerPlan(nothing, prices, report_of(candidates, nothing, base, prices, 1.0))

    def _first_rows(
        self, contexts: list[int], most: int, base_tokens: int, base_seqs: int, base_pairs: float
    ) -> tuple[list[float], float, Prices]:
        """For candidates of ``contexts`` (``most`` slots at most) in a step of several
        sequences: per candidate the tokens its first row costs at the hurdle's goodput (what
        a first draft's chance must beat), the plain step's seconds, and the plain plan's
        prices."""
        plain, fit = self._batch_fits(base_tokens, base_seqs, len(contexts), most)
        base = plain.seconds(base_tokens, base_seqs, base_pairs)
        ratio = len(contexts) / base
        floor = ratio * (1 + self.tuning.hurdle) * (1 - 1e-9)  # a hair: rounding never skips
        worth = [floor * fit.row(float(context)) for context in contexts]
        return worth, base, Prices(fit.row(0.0), fit.per_pair, 0.0, ratio)

    def beyond_reach(
        self, contexts: list[int], most: int, base_tokens: int, base_seqs: int, base_pairs: float
    ) -> list[bool]:
        """Per candidate of a step (by its context; ``most`` slots at most), whether no draft
        of it can pay this step whatever its proposers would find: its first row costs a
        token or more at the hurdle's goodput, and no draft's chance exceeds 1. Its lookups
        need not be made (at batch 32 and 64 in the gguf mode, every candidate's on most
        steps). Nothing before the step-time model is ready, or at batch 1."""
        if not contexts or base_seqs <= 1 or not self.times.ready:
            return [False] * len(contexts)
        worth = self._first_rows(contexts, most, base_tokens, base_seqs, base_pairs)[0]
        return [tokens >= 1.0 for tokens in worth]

    def _probed(
        self,
        chosen: list[tuple[int, int]],
        options: _Options,
        ratio: float,
        catch_ups: list[int],
    ) -> list[tuple[int, int]]:
        """``chosen`` with the one draft more (a probe is due) that costs the plan least, of
        those ``probe_free`` allows (``chosen`` itself where none is)."""
        gains, costs, valid = options.gains, options.costs, options.valid
        _count, ways, slots = gains.shape
        draft = self.ways.index(DRAFT) if DRAFT in self.ways else None
        depth = max((d + 1 for w, d in chosen if w == draft and d >= 0), default=0)
        best, probe = -np.inf, None
        for i, (w, d) in enumerate(chosen):
            for way in range(ways) if d < 0 else (w,):
                j = d + 1
                if j >= slots or not valid[i, way, j]:
                    continue
                if not probe_free(way == draft, j, catch_ups[i]):
                    continue
                cost = costs[i, way, j]
                if way == draft and j + 1 > depth:  # one more draft-model forward
                    cost += options.draft_fit[0]
                value = gains[i, way, j] - ratio * cost
                if value > best:
                    best, probe = value, (i, way, j)
        if probe is None:
            return chosen
        i, way, j = probe
        probed = list(chosen)
        probed[i] = (way, j)
        return probed

    def _options(
        self, candidates: list[Candidate], base_tokens: int, base_seqs: int, base_pairs: float = 0.0
    ) -> _Options:
        """Per candidate, way and draft position: the chance it is emitted, the seconds it
        adds (the draft model's per-forward cost aside), whether it may be drafted; each
        weighted by the chance that the proposer makes it when allotted."""
        count = len(candidates)
        ways = self.ways
        if any(c.forced for c in candidates):
            ways = (*ways, FORCED)
        table = np.array(
            [(c.slots, c.context, c.catch_up) for c in candidates], dtype=np.float64
        ).reshape(count, 3)
        slots, context = table[:, 0].astype(np.int64), table[:, 1]
        most = max(c.slots for c in candidates)  # (numpy's reductions: ~20 us a call here)
        row, base_cost, prices = self._row_prices(base_tokens, base_seqs, base_pairs, context, most)
        draft_fit = self.draft_times.fit(count) if DRAFT in ways else (0.0, 0.0)
        acceptance = self.acceptance
        usable = np.zeros((count, len(ways)), dtype=np.int64)
        first = np.zeros(usable.shape)
        seq_ids = [c.seq_id for c in candidates]
        for w, way in enumerate(ways):
            if not way.copies:  # a way that drafts its own: every slot
                usable[:, w] = slots
                first[:, w] = acceptance.firsts(way, seq_ids)
                continue
            # a way that copies (a lookup of the matched length, the store, forced tokens):
            # the candidates with something to copy, as much as their slots take
            copies = [c.copied(way) or [] for c in candidates]
            index = [i for i, copy in enumerate(copies) if copy]
            if index:
                usable[index, w] = [min(slots[i], len(copies[i])) for i in index]
                first[index, w] = acceptance.firsts(way, [seq_ids[i] for i in index])
        follow = np.cumprod(acceptance.follow_rows(ways, most), axis=1)
        positions = np.arange(most)
        valid = positions[None, None, :] < usable[:, :, None]
        calibration = np.array([acceptance.calibration(way) for way in ways])
        uncalibrated = np.where(valid, first[:, :, None] * follow[None], 0.0)
        made = acceptance.made_rows(ways, most)[None]
        gains = np.minimum(calibration[None, :, None] * uncalibrated, 1.0) * made
        # the proposer's work for draft j is done when j is made, and for the first whenever
        # one is allotted (a draft model may drop a first draft it computed)
        ran = made.copy()
        ran[..., 0] = 1.0
        # a draft-model draft adds a row to a draft forward (the first: one catch-up row, see
        # the module docstring); an application's proposer its measured time per draft
        proposing = np.array(self.proposing_seconds(ways, draft_fit))[None, :, None] * ran
        costs = np.where(valid, row[:, None, :] * made + proposing, 0.0)
        if DRAFT in ways:  # the backlog a draft model must catch up on
            catch_up = np.maximum(table[:, 2], 1.0)
            backlog = catch_up - 1.0  # beyond the row a step costs anyway
            # at the per-row cost of a forward of the catch-up's size, not of a one-row-per-
            # sequence forward (whose slope, near one row, says little about 40 rows)
            rows = float(catch_up.sum())
            per_row = draft_fit[1]
            if rows > count:
                per_row = self.draft_times.fit(rows)[1]
            costs[:, ways.index(DRAFT), 0] += per_row * backlog
        return _Options(
            ways, gains, costs, valid, uncalibrated, made[0], ran[0], draft_fit, base_cost, prices
        )

    def _row_prices(
        self, base_tokens: int, base_seqs: int, base_pairs: float, context: np.ndarray, most: int
    ) -> tuple[np.ndarray, StepCost, Prices]:
        """Seconds each candidate's draft j adds to the step (candidates x ``most``), the fit
        of the plain step, and the price of one more row.

        For a single sequence (batch 1) a row costs what it adds where it lands: draft j
        takes the step from ``base + j`` to ``base + j + 1`` rows, so its price is the
        difference of the model's predicted step times at those sizes, plus the per-pair
        slope times how far the candidate's context is from the mean. Differences of
        predicted times, not a slope: with padded products a batch-1 step of 1..4 rows costs
        the same here and rows past them do not, a kink that local fits predict well at the
        sizes themselves and badly as a slope. Larger steps are priced by the local slope
        around the step with half the slots drafted (their time grows smoothly with rows,
        and sizes several times the measured ones are extrapolations), the plain step by the
        fit around itself, where its own decodes are (read off the fit at half the slots, a
        batch-64 decode once came out at 5x its time)."""
        count = len(context)
        positions = np.arange(most)
        if base_seqs > 1:
            plain, fit = self._batch_fits(base_tokens, base_seqs, count, most)
            prices = Prices(fit.row(0.0), fit.per_pair, 0.0)
            rows = fit.per_token + fit.per_pair * (context[:, None] + positions[None, :])
            return rows, plain, prices
        mean_context = float(context.sum()) / count
        step, per_pair, base_fit = self.batch_one_rows(
            base_tokens, base_pairs, mean_context, count, most
        )
        prices = Prices(float(step[0]), float(per_pair[0]), mean_context)
        offset = context[:, None] - mean_context
        rows = np.maximum(np.array(step)[None, :] + np.array(per_pair)[None, :] * offset, 0.0)
        return rows, base_fit, prices

    def _batch_fits(
        self, base_tokens: int, base_seqs: int, count: int, most: int
    ) -> tuple[StepCost, StepCost]:
        """A step of several sequences: the fit of its plain step and the one its rows are
        priced by, around the step with half of ``count`` candidates' ``most`` slots drafted
        (see ``_row_prices``)."""
        half = base_tokens + count * most / 2
        plain, fit = self.times.fits([float(base_tokens), half], base_seqs)
        return plain, fit

    def batch_one_rows(
        self, base_tokens: int, base_pairs: float, mean_context: float, count: int, most: int
    ) -> tuple[list[float], list[float], StepCost]:
        """A one-sequence step's ``_row_prices`` before the offsets of the candidates'
        contexts: per draft position the seconds a row adds there at ``mean_context`` and the
        per-pair slope, and the plain step's fit."""
        sizes = [float(base_tokens + count * j) for j in range(most + 1)]
        fits = self.times.fits(sizes, 1)
        seconds = [
            fit.seconds(tokens, 1, base_pairs + count * j * (mean_context + (j - 1) / 2))
            for j, (tokens, fit) in enumerate(zip(sizes, fits, strict=True))
        ]
        step = [max((after - before) / count, 0.0) for before, after in itertools.pairwise(seconds)]
        return step, [fit.per_pair for fit in fits[1:]], fits[0]

    def proposing_seconds(
        self, ways: tuple[Way, ...], draft_fit: tuple[float, float]
    ) -> list[float]:
        """Per way, the proposer's seconds per draft it makes: a draft model's row in its
        forward (``draft_fit``), an application's proposer's measured time, 0 for the rest."""
        seconds, drafts = self._external
        per_draft = {DRAFT: draft_fit[1], EXTERNAL: seconds / drafts if drafts else 0.0}
        return [per_draft.get(way, 0.0) for way in ways]

    def _solve(
        self, options: _Options, seqs: int, base: float
    ) -> tuple[list[tuple[int, int]], float]:
        """The goodput-maximising (way, last draft index) per candidate (-1: none), and that
        goodput in tokens per second."""
        gains, valid = options.gains, options.valid
        cum_gains, cum_costs = np.cumsum(gains, axis=2), np.cumsum(options.costs, axis=2)
        draft = self.ways.index(DRAFT) if DRAFT in self.ways else None
        depths = range(gains.shape[2] + 1) if draft is not None else (0,)
        forwards = np.zeros(gains.shape[2] + 1)
        if draft is not None:
            # draft forward j runs when any sequence allotted more than j drafts made j of
            # them (the first whenever one is allotted): exact for one sequence, an upper
            # bound (all of them allotted) for more
            drafting = valid[:, draft].sum(axis=0)
            runs = 1.0 - (1.0 - options.ran[draft]) ** np.maximum(drafting, 1)
            forwards[1:] = np.cumsum(runs)
        per_forward = options.draft_fit[0]
        plain = seqs / base
        floor = plain * (1 + self.tuning.hurdle)
        bases = base + per_forward * forwards[: len(depths)]
        best = best_by_depth(cum_gains, cum_costs, valid, draft, bases, seqs, floor)
        if best[1] <= floor:  # nothing cleared the hurdle: the plain step
            return [(0, -1)] * seqs, plain
        return best

    def choose_ways(self, candidates: list[Candidate]) -> list[Choice]:
        """Under a fixed k (every slot drafted, no plan): each candidate's way, the one whose
        drafts are worth most at the plain step's goodput (the tokens they are expected to
        add less what their time would have made; before steps are measured, the most
        expected tokens)."""
        self.acceptance.step += 1
        if not candidates:
            return []
        count = len(candidates)
        pairs = float(sum(c.context for c in candidates))
        options = self._options(candidates, count, count, pairs)
        usable = options.valid.sum(axis=2)  # candidates x ways
        last = np.maximum(usable - 1, 0)[..., None]
        gain = np.take_along_axis(np.cumsum(options.gains, axis=2), last, axis=2)[..., 0]
        cost = np.take_along_axis(np.cumsum(options.costs, axis=2), last, axis=2)[..., 0]
        if DRAFT in self.ways:  # a draft-model chain runs a forward per draft
            draft = self.ways.index(DRAFT)
            cost[:, draft] += usable[:, draft] * options.draft_fit[0]
        rate = 0.0
        if self.times.ready:
            rate = count / options.base_cost.seconds(count, count, pairs)
        value = np.where(usable > 0, gain - rate * cost, -np.inf)
        expected = np.cumsum(options.uncalibrated, axis=2)
        choices = []
        for i in range(count):
            w = int(value[i].argmax())
            if not np.isfinite(value[i, w]):
                choices.append(Choice(None, 0))
                continue
            drafts = int(usable[i, w])
            way = options.ways[w]
            choices.append(Choice(way, drafts, tuple(expected[i, w, :drafts].tolist())))
        return choices

    def plain_step(self) -> None:
        """A step planned without drafts by rule (it computes a prompt): time still passes
        for the acceptance estimates."""
        self.acceptance.step += 1

    def observe_step(
        self,
        tokens: int,
        seqs: int,
        pairs: float,
        seconds: float,
        share: float = 1.0,
        decodes: bool = True,
    ) -> None:
        """A finished step: its forward's size, its time without a draft model's, the
        process's share of the cores meanwhile, and whether it only decoded (see
        ``step_times``)."""
        self.times.observe(tokens, seqs, pairs, seconds, share, decodes)

    def observe_draft_forward(self, rows: int, seconds: float, share: float = 1.0) -> None:
        self.draft_times.observe(rows, seconds, share)

    def observe_external(self, drafts: int, seconds: float) -> None:
        """An application's proposer took ``seconds`` for ``drafts`` drafts."""
        if drafts:
            decay = self.tuning.shared_decay
            total, count = self._external
            self._external = (decay * total + seconds, decay * count + drafts)

    def observe_verify(
        self,
        seq_id: int,
        way: Way,
        num_drafts: int,
        num_accepted: int,
        expected: float | None = None,
    ) -> None:
        """Drafts judged: by a verify (``expected``: what the plan expected of them, for the
        way's calibration) or by comparing an unused lookup with what the target emitted."""
        self.acceptance.observe(seq_id, way, num_drafts, num_accepted)
        if expected is not None:
            self.acceptance.calibrate(way, expected, num_accepted)

    def observe_beyond(self, way: Way, offset: int, num_drafts: int, num_accepted: int) -> None:
        """Drafts of ``way`` at positions ``offset ..`` past a verified, all-accepted chain of
        ``offset`` drafts, judged by what the target emitted: the first ``num_accepted`` of
        ``num_drafts`` right."""
        self.acceptance.observe_beyond(way, offset, num_drafts, num_accepted)

    def observe_made(self, way: Way, allotted: int, made: int) -> None:
        """The proposer of ``way`` made ``made`` of the ``allotted`` drafts a plan gave."""
        self.acceptance.observe_made(way, allotted, made)

    def forget(self, seq_id: int) -> None:
        self.acceptance.forget(seq_id)


@dataclass(frozen=True)
class _Options:
    """Per candidate, way and draft position (``made``: per way and position)."""

    ways: tuple[Way, ...]  # the controller's, and FORCED when a candidate has forced tokens
    gains: np.ndarray  # chance the draft is emitted: made, accepted, calibrated
    costs: np.ndarray  # seconds it adds if allotted (times the chance it is made)
    valid: np.ndarray  # whether it may be drafted
    uncalibrated: np.ndarray  # chance it is accepted once made, before calibration
    made: np.ndarray  # chance the proposer makes it when allotted
    ran: np.ndarray  # chance the proposer works for it when allotted (made, or the first)
    draft_fit: tuple[float, float]  # a draft forward's (fixed, per row) seconds near this step
    base_cost: StepCost  # the fit of the plain step
    prices: Prices  # of one more verify row
