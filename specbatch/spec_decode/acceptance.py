"""How likely a sequence's next drafts are to be accepted, per way of drafting and position.

Acceptance is per sequence (a summary copies, a poem does not), per way (a 3-token prompt-lookup
match is better evidence than a 1-token one; a draft model is its own way), and bursty: a lookup
that is right for one token is usually right for the next, so the chance of draft ``j`` given
draft ``j - 1`` was accepted is learned per position, not taken as a power of the first. A
sequence's first-draft rate is a decaying count of its own outcomes pulled towards the rate of
all sequences drafted that way (a new sequence starts from the population's rate); counts decay
per outcome and, more slowly, per step without one, so a sequence that stopped drafting drifts
back to the population's rate and is tried again when that pays. Every estimate is a ratio of
decayed counts with a prior: no rate is ever exactly 0 or 1.

A plan uses an optimistic first-draft rate for a way the sequence has (almost) no recent
outcomes of (:meth:`AcceptanceModel.optimistic`): the estimate plus ``EXPLORE`` standard
errors. Without that, two unlucky verifies of a new sequence's draft model would rule the draft
model out for good (no drafts, no outcomes, no correction); with it the way is probed again
once its outcomes have decayed (~``1 / (1 - IDLE_DECAY)`` idle steps) if it could pay. A way in
use has outcomes and gets no bonus (a permanent one would keep paying for drafts that lose);
where a row is dear (big batches) even an optimistic rate does not pay, so probes cost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DECAY = 0.9  # a sequence keeps this much of its history per outcome
IDLE_DECAY = 0.97  # ... and this much per step without an outcome
SHARED_DECAY = 0.99  # the same for the rates shared by all sequences
PRIOR_WEIGHT = 2.0  # pseudo-outcomes at the population's rate behind each sequence's own
SHARED_PRIOR = 0.5  # the population's rate before any outcome (one pseudo-outcome)
EXPLORE = 1.0  # standard errors added to the first-draft rate of a way being probed
PROBE_BELOW = 1.0  # ... a way with fewer decayed outcomes than this for the sequence


@dataclass
class DecayedRate:
    """Decayed counts of accepted and of all outcomes."""

    hits: float = 0.0
    total: float = 0.0

    def observe(self, accepted: bool, decay: float) -> None:
        self.hits = decay * self.hits + accepted
        self.total = decay * self.total + 1.0

    def rate(self, prior: float, weight: float, scale: float = 1.0) -> float:
        return (scale * self.hits + weight * prior) / (scale * self.total + weight)


@dataclass
class _SequenceRate:
    rate: DecayedRate
    step: int  # when it last had an outcome


class AcceptanceModel:
    """Per (sequence, way) first-draft rates and per (way, position) follow-on rates."""

    def __init__(self) -> None:
        self._first: dict[tuple[int, str], _SequenceRate] = {}
        self._shared_first: dict[str, DecayedRate] = {}
        self._follow: dict[str, list[DecayedRate]] = {}
        self.step = 0  # advanced by the controller once per planned step

    def population(self, way: str) -> float:
        shared = self._shared_first.get(way)
        return SHARED_PRIOR if shared is None else shared.rate(SHARED_PRIOR, 1.0)

    def first(self, seq_id: int, way: str) -> float:
        """The chance that the sequence's next first draft drafted ``way`` is accepted."""
        prior = self.population(way)
        state = self._first.get((seq_id, way))
        if state is None:
            return prior
        scale = IDLE_DECAY ** max(self.step - state.step, 0)
        return state.rate.rate(prior, PRIOR_WEIGHT, scale)

    def optimistic(self, seq_id: int, way: str) -> float:
        """:meth:`first`, plus ``EXPLORE`` standard errors (its effective outcomes: the
        sequence's decayed count plus the prior's weight) while the sequence has fewer than
        ``PROBE_BELOW`` decayed outcomes of the way."""
        rate = self.first(seq_id, way)
        state = self._first.get((seq_id, way))
        seen = 0.0
        if state is not None:
            seen = state.rate.total * IDLE_DECAY ** max(self.step - state.step, 0)
        if seen >= PROBE_BELOW:
            return rate
        bonus = EXPLORE * math.sqrt(rate * (1.0 - rate) / (seen + PRIOR_WEIGHT))
        return min(rate + bonus, 1.0)

    def follow(self, way: str, count: int) -> np.ndarray:
        """Chance that draft ``j`` (1 .. count - 1) is accepted given draft ``j - 1`` was;
        entry 0 is 1."""
        rates = self._follow.get(way, [])
        out = np.ones(count)
        for j in range(1, count):
            out[j] = rates[j].rate(SHARED_PRIOR, 1.0) if j < len(rates) else SHARED_PRIOR
        return out

    def gains(self, seq_id: int, way: str, count: int) -> np.ndarray:
        """Chance that each of the next ``count`` drafts is emitted (it and every one before
        it accepted)."""
        return self.first(seq_id, way) * np.cumprod(self.follow(way, count))

    def observe(self, seq_id: int, way: str, num_drafts: int, num_accepted: int) -> None:
        """``num_drafts`` drafts of ``way`` were judged (verified, or compared with what the
        target emitted) and the first ``num_accepted`` were right."""
        if num_drafts <= 0:
            return
        first = num_accepted > 0
        state = self._first.get((seq_id, way))
        if state is None:
            state = self._first[(seq_id, way)] = _SequenceRate(DecayedRate(), self.step)
        scale = IDLE_DECAY ** max(self.step - state.step, 0)
        state.rate.hits *= scale
        state.rate.total *= scale
        state.rate.observe(first, DECAY)
        state.step = self.step
        self._shared_first.setdefault(way, DecayedRate()).observe(first, SHARED_DECAY)
        follow = self._follow.setdefault(way, [])
        while len(follow) < num_drafts:
            follow.append(DecayedRate())
        for position in range(1, min(num_accepted + 1, num_drafts)):
            follow[position].observe(position < num_accepted, SHARED_DECAY)

    def forget(self, seq_id: int) -> None:
        for key in [key for key in self._first if key[0] == seq_id]:
            del self._first[key]
