"""How likely a sequence's next drafts are to be accepted, per way of drafting and position.

Acceptance is per sequence (a summary copies, a poem does not), per way (a 3-token prompt-lookup
match is better evidence than a 1-token one; a draft model is its own way), and bursty: a lookup
that is right for one token is usually right for the next, so the chance of draft ``j`` given
draft ``j - 1`` was accepted is learned per position, not taken as a power of the first. A
sequence's first-draft rate is a decaying count of its own outcomes pulled towards the rate of
all sequences drafted that way (a new sequence starts from the population's rate). Every
estimate is a ratio of decayed counts with ``prior_weight`` pseudo-outcomes at its prior: no
rate is ever exactly 0 or 1. A bursty way's (a lookup's) per-sequence counts keep
``sequence_decay`` per outcome, a steady way's (a draft model's: its rate is the text's)
``steady_decay``; shared counts (a population's, a position's) ``shared_decay``.

The sequences a plan drafts are the ones whose estimates are highest, so their estimates are
biased up (the winner's curse). Per way, a calibration factor corrects it: the decayed sum of
drafts accepted over the decayed sum the plans expected of them (``calibration``, at most 1:
it corrects optimism), applied to every gain of that way.

A proposer may give fewer drafts than it was allotted (a draft model's confidence stop: it
stops once its own probability that every draft so far is right falls below a threshold). Per
(way, position) the chance that draft ``j`` is made given draft ``j - 1`` was is learned too
(``made``): a draft that is not made costs nothing, and the drafts that are made are the
confident ones, whose follow-on rates (learned from verifies of made drafts only) are higher.

There is no separate exploration: every estimate that nothing refreshes drifts back to its
prior (``steady_decay`` per step since its last outcome; the calibration sums keep
``shared_decay``): a sequence's rate to its population's, a population's to 0.5, a
per-position rate (follow-on, made) to its prior, a calibration factor to 1. So a way or a
depth that a few early outcomes ruled out (sequences in lockstep miss together; a follow-on
rate is learned only from verifies of two or more drafts) is tried again once its prior pays
at the current batch size, and its true rate is learned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from specbatch.spec_decode.tuning import SpeculationTuning

if TYPE_CHECKING:
    from specbatch.spec_decode.control.choices import Way

UNINFORMED = 0.5  # the prior of a rate nothing has measured: as likely right as wrong


@dataclass
class DecayedRate:
    """Decayed counts of accepted and of all outcomes."""

    hits: float = 0.0
    total: float = 0.0

    def observe(self, accepted: bool, decay: float) -> None:
        self.hits = decay * self.hits + accepted
        self.total = decay * self.total + 1.0

    def rate(self, prior: float, weight: float, scale: float = 1.0) -> float:
        return _pulled(self.hits, self.total, scale, prior, weight)


def _pulled(hits: float, total: float, scale: float, prior: float, weight: float) -> float:
    """Counts scaled by ``scale`` (their idle decay), pulled towards ``prior`` with the
    weight of ``weight`` outcomes."""
    return (scale * hits + weight * prior) / (scale * total + weight)


@dataclass
class _TimedRate:
    """A rate and the step of its last outcome: its counts decay by ``idle`` per step since
    then, so an estimate that nothing refreshes returns to its prior."""

    rate: DecayedRate
    step: int  # when it last had an outcome
    idle: float

    def observe(self, accepted: bool, decay: float, step: int) -> None:
        scale = self.idle ** max(step - self.step, 0)
        self.rate.hits *= scale
        self.rate.total *= scale
        self.rate.observe(accepted, decay)
        self.step = step

    def value(self, prior: float, weight: float, step: int) -> float:
        return self.rate.rate(prior, weight, self.idle ** max(step - self.step, 0))


class _PositionRates:
    """One way's timed rates per draft position (follow-on or made), kept in plain lists: a
    plan reads every position of every way each step, a handful of floats each, where
    numpy's per-call cost and a loop over per-position objects each cost more than the
    rest of the plan's estimates."""

    def __init__(self, idle: float) -> None:
        self.idle = idle
        self.hits: list[float] = []
        self.total: list[float] = []
        self.step: list[int] = []  # when each position last had an outcome

    def observe(self, start: int, stop: int, right_below: int, decay: float, step: int) -> None:
        """Outcomes at positions ``start .. stop - 1``: right below position ``right_below``,
        wrong from it on (a position seen for the first time starts empty at ``step``)."""
        grow = stop - len(self.hits)
        if grow > 0:
            self.hits += [0.0] * grow
            self.total += [0.0] * grow
            self.step += [step] * grow
        for position in range(start, stop):
            scale = self.idle ** max(step - self.step[position], 0)
            self.hits[position] = decay * (self.hits[position] * scale) + (position < right_below)
            self.total[position] = decay * (self.total[position] * scale) + 1.0
            self.step[position] = step

    def values(self, count: int, prior: float, weight: float, step: int) -> list[float]:
        """The rates of positions ``0 .. count - 1`` (``prior`` where none was seen)."""
        out = []
        seen = zip(self.hits[:count], self.total[:count], self.step[:count], strict=True)
        for hits, total, last in seen:
            out.append(_pulled(hits, total, self.idle ** max(step - last, 0), prior, weight))
        return out + [prior] * (count - len(out))


class AcceptanceModel:
    """Per (sequence, way) first-draft rates and per (way, position) follow-on rates."""

    def __init__(self, tuning: SpeculationTuning | None = None) -> None:
        self.tuning = tuning = tuning or SpeculationTuning()
        self._idle = tuning.steady_decay
        self._weight = tuning.prior_weight
        self._first: dict[tuple[int, Way], _TimedRate] = {}
        self._shared_first: dict[Way, _TimedRate] = {}
        self._follow: dict[Way, _PositionRates] = {}
        self._made: dict[Way, _PositionRates] = {}
        # way -> (accepted, expected, step of the last update)
        self._calibration: dict[Way, tuple[float, float, int]] = {}
        self.step = 0  # advanced by the controller once per planned step

    def population(self, way: Way) -> float:
        shared = self._shared_first.get(way)
        if shared is None:
            return UNINFORMED
        return shared.value(UNINFORMED, self._weight, self.step)

    def first(self, seq_id: int, way: Way) -> float:
        """The chance that the sequence's next first draft drafted ``way`` is accepted."""
        return self.firsts(way, (seq_id,))[0]

    def firsts(self, way: Way, seq_ids: Iterable[int]) -> list[float]:
        """``first`` of each of ``seq_ids`` drafting ``way`` (a plan asks for every
        candidate's each step: one pass, the population's rate found once)."""
        prior = self.population(way)
        states, step, weight = self._first, self.step, self._weight
        out = []
        for seq_id in seq_ids:
            state = states.get((seq_id, way))
            out.append(prior if state is None else state.value(prior, weight, step))
        return out

    def follow_rows(self, ways: tuple[Way, ...], count: int) -> np.ndarray:
        """Per way (ways x count), the chance that draft ``j`` (1 .. count - 1) is accepted
        given draft ``j - 1`` was; entry 0 is 1."""
        return np.array(self.follow_lists(ways, count), dtype=np.float64).reshape(len(ways), count)

    def follow_lists(self, ways: tuple[Way, ...], count: int) -> list[list[float]]:
        """``follow_rows`` as lists (a batch-1 plan's, in plain floats)."""
        rows = self._rows(self._follow, ways, count, UNINFORMED)
        for row in rows:
            if row:
                row[0] = 1.0
        return rows

    def made_rows(self, ways: tuple[Way, ...], count: int) -> np.ndarray:
        """Per way (ways x count), the chance that draft ``j`` is made when ``count`` are
        allotted: the proposer made every one before it and did not stop (1 until a
        proposer stops early or drops a first draft)."""
        return np.array(self.made_lists(ways, count), dtype=np.float64).reshape(len(ways), count)

    def made_lists(self, ways: tuple[Way, ...], count: int) -> list[list[float]]:
        """``made_rows`` as lists (a batch-1 plan's, in plain floats)."""
        out = []
        for rates in self._rows(self._made, ways, count, 1.0):
            chance, made = 1.0, []
            for rate in rates:
                chance *= rate
                made.append(chance)
            out.append(made)
        return out

    def _rows(
        self, table: dict[Way, _PositionRates], ways: tuple[Way, ...], count: int, prior: float
    ) -> list[list[float]]:
        """The position rates of each of ``ways`` in ``table`` (a way not in it: ``prior``)."""
        rows = []
        for way in ways:
            rates = table.get(way)
            if rates is None:
                rows.append([prior] * count)
            else:
                rows.append(rates.values(count, prior, self._weight, self.step))
        return rows

    def observe_made(self, way: Way, allotted: int, made: int) -> None:
        """The proposer made ``made`` of the ``allotted`` drafts of ``way``."""
        if allotted <= 0:
            return
        rates = self._made.setdefault(way, _PositionRates(self._idle))
        rates.observe(0, min(made + 1, allotted), made, self.tuning.shared_decay, self.step)

    def observe(self, seq_id: int, way: Way, num_drafts: int, num_accepted: int) -> None:
        """``num_drafts`` drafts of ``way`` were judged (verified, or compared with what the
        target emitted) and the first ``num_accepted`` were right."""
        if num_drafts <= 0:
            return
        first = num_accepted > 0
        state = self._first.get((seq_id, way))
        if state is None:
            state = self._first[(seq_id, way)] = self._timed()
        # a steady way's (a draft model's) rate is kept longer than a bursty one's (a
        # lookup's: right through a copied span, then not)
        decay = self.tuning.steady_decay if way.steady else self.tuning.sequence_decay
        state.observe(first, decay, self.step)
        shared = self._shared_first.setdefault(way, self._timed())
        shared.observe(first, self.tuning.shared_decay, self.step)
        follow = self._follow.setdefault(way, _PositionRates(self._idle))
        stop = min(num_accepted + 1, num_drafts)
        follow.observe(1, stop, num_accepted, self.tuning.shared_decay, self.step)

    def _timed(self) -> _TimedRate:
        return _TimedRate(DecayedRate(), self.step, self._idle)

    def observe_beyond(self, way: Way, offset: int, num_drafts: int, num_accepted: int) -> None:
        """Follow-on outcomes at positions ``offset .. offset + num_drafts - 1`` given every
        position below ``offset`` right (drafts judged past a chain's last verified one):
        right below ``offset + num_accepted``, up to and including the first miss."""
        if num_drafts <= 0 or offset <= 0:
            return
        follow = self._follow.setdefault(way, _PositionRates(self._idle))
        stop = offset + min(num_accepted + 1, num_drafts)
        follow.observe(offset, stop, offset + num_accepted, self.tuning.shared_decay, self.step)

    def calibration(self, way: Way) -> float:
        """Drafts of ``way`` accepted per draft the plans expected to be by the uncalibrated
        estimates (decayed, with the prior at a factor of 1), at most 1."""
        accepted, expected = self._calibration_sums(way)
        weight = self._weight
        return min((accepted + weight) / (expected + weight), 1.0)

    def calibrate(self, way: Way, expected: float, accepted: int) -> None:
        """A verify of a plan's drafts: ``expected`` accepted by its estimates before
        calibration (against calibrated ones the factor would settle at the square root of
        the bias), ``accepted`` in fact."""
        old_accepted, old_expected = self._calibration_sums(way)
        decay = self.tuning.shared_decay
        self._calibration[way] = (
            decay * old_accepted + accepted,
            decay * old_expected + expected,
            self.step,
        )

    def _calibration_sums(self, way: Way) -> tuple[float, float]:
        """The sums as of now: they keep ``shared_decay`` per step too, so that a way no plan
        uses (its factor frozen low: nothing to correct it) returns to a factor of 1 and is
        judged on its rates again."""
        accepted, expected, step = self._calibration.get(way, (0.0, 0.0, self.step))
        idle = self.tuning.shared_decay ** max(self.step - step, 0)
        return accepted * idle, expected * idle

    def forget(self, seq_id: int) -> None:
        for key in [key for key in self._first if key[0] == seq_id]:
            del self._first[key]
