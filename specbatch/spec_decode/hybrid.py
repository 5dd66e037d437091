"""Prompt lookup where the sequence repeats itself, the draft model everywhere else.

Copying spans of the prompt (summaries, extraction, code edits, answers that quote the question)
is free and often long; free text is where a draft model helps. Each step every sequence is first
looked up; a match of at least ``prompt_lookup_min`` tokens is used as it is. For the others
there are two ways to draft: the draft model, or a shorter lookup (a match of fewer tokens,
weaker evidence but free) when one exists. Which pays depends on the text (the draft model is
poor on long documents it was not trained on, a 1-token match is poor in free writing), so each
sequence keeps, per way, the smoothed tokens it gained per step and the draft forwards it cost,
tries each way a couple of times, then takes the better value (tokens per step over the step's
relative cost, a draft forward costing ``c`` of a step, measured as it runs) and re-tries the
other every few steps. The draft model, in one batch for all the sequences that use it, catches
up on the tokens it did not see the next time it drafts for a sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specbatch.sequence import Sequence
from specbatch.spec_decode.draft_model import DraftModelProposer
from specbatch.spec_decode.ngram import NgramProposer
from specbatch.spec_decode.proposer import DraftRequest, Proposal, Proposer, with_point_masses

EXPLORE_STEPS = 2  # tries of each way before values are compared
PROBE_EVERY = 8  # every so many choices, the way that lost is tried again
SMOOTHING = 0.25  # weight of the newest step in a way's running value
DRAFT_COST_PRIOR = 0.1  # a draft forward relative to the rest of a step, until measured
IDLE_CLAMP = 3.0  # a gap between steps counts as at most this many typical steps

LOOKUP, DRAFT = "lookup", "draft"


@dataclass
class _Way:
    """Smoothed tokens emitted per step (accepted drafts + 1) and draft forwards per step."""

    steps: int = 0
    tokens: float = 1.0
    forwards: float = 0.0

    def update(self, tokens: int, forwards: int) -> None:
        weight = max(1.0 / (self.steps + 1), SMOOTHING)  # a plain mean first, then smoothed
        self.tokens += weight * (tokens - self.tokens)
        self.forwards += weight * (forwards - self.forwards)
        self.steps += 1


@dataclass
class _SequenceChoice:
    ways: dict[str, _Way] = field(default_factory=lambda: {LOOKUP: _Way(), DRAFT: _Way()})
    choices: int = 0
    pending: tuple[str, int, int] | None = None  # (way, accepted before, draft forwards)


def choose_way(ways: dict[str, _Way], choices: int, draft_cost: float) -> str:
    """The way to draft a sequence with no long match: explore both, then the better value,
    re-trying the other every ``PROBE_EVERY`` choices."""
    if ways[DRAFT].steps < EXPLORE_STEPS:
        return DRAFT
    if ways[LOOKUP].steps < EXPLORE_STEPS:
        return LOOKUP
    draft_value = ways[DRAFT].tokens / (1.0 + draft_cost * ways[DRAFT].forwards)
    best, other = (DRAFT, LOOKUP) if draft_value > ways[LOOKUP].tokens else (LOOKUP, DRAFT)
    return other if choices % PROBE_EVERY == PROBE_EVERY - 1 else best


class HybridProposer(Proposer):
    """Long prompt-lookup matches first; the draft model or a short match for the rest."""

    def __init__(
        self,
        lookup: NgramProposer,
        drafter: DraftModelProposer,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.lookup = lookup
        self.drafter = drafter
        self.clock = clock
        self._choices: dict[int, _SequenceChoice] = {}
        # draft forward time and the rest of a step's time, smoothed, for the draft cost c
        self._forward_s: float | None = None
        self._rest_s: float | None = None
        self._last_start: float | None = None
        self._last_draft_s = 0.0

    @property
    def draft_cost(self) -> float:
        """One draft forward's time over the rest of a step's (target forward, sampling)."""
        if self._forward_s is None or not self._rest_s:
            return DRAFT_COST_PRIOR
        return self._forward_s / self._rest_s

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        start = self.clock()
        if self._last_start is not None:
            rest = max(start - self._last_start - self._last_draft_s, 0.0)
            if self._rest_s:  # an engine idle between requests is not a slow step
                rest = min(rest, IDLE_CLAMP * self._rest_s)
            self._rest_s = _smooth(self._rest_s, rest)
        self._last_start, self._last_draft_s = start, 0.0
        tokens: list[list[int]] = []
        parents: list[list[int] | None] = [None] * len(requests)
        to_draft = []
        for i, r in enumerate(requests):
            state = self._choices.setdefault(r.seq.seq_id, _SequenceChoice())
            state.pending = None
            # one scan down to 1 token: the longest match, long or short
            found, length = self.lookup.match(r.seq, r.max_drafts, min_n=1)
            if length >= self.lookup.min_n:  # a long match: taken as it is
                looked_up, parents[i] = self.lookup.drafts(r.seq, found, length, r.max_drafts)
                tokens.append(looked_up)
                continue
            tokens.append([])
            way = DRAFT
            if found:  # a short match: it or the draft model, whichever has paid better
                way = choose_way(state.ways, state.choices, self.draft_cost)
                state.choices += 1
            if way == LOOKUP:
                tokens[i], parents[i] = self.lookup.drafts(r.seq, found, length, r.max_drafts)
            else:
                to_draft.append(i)
            state.pending = (way, r.seq.spec.num_accepted_tokens, 0)
        if not to_draft:
            return Proposal(tokens, parents=_trees(parents))
        forwards_before = self.drafter.num_forwards
        drafted = self.drafter.propose([requests[i] for i in to_draft])
        self._last_draft_s = self.clock() - start
        forwards = self.drafter.num_forwards - forwards_before
        if forwards:
            self._forward_s = _smooth(self._forward_s, self._last_draft_s / forwards)
        for s, (i, row) in enumerate(zip(to_draft, drafted.tokens, strict=True)):
            tokens[i] = row
            parents[i] = drafted.parents_of(s)
            state = self._choices[requests[i].seq.seq_id]
            if state.pending is not None:
                state.pending = (DRAFT, state.pending[1], len(row))
        trees = _trees(parents)
        if drafted.draft_probs is None:
            return Proposal(tokens, parents=trees)
        return Proposal(tokens, with_point_masses(tokens, to_draft, drafted.draft_probs), trees)

    def on_verified(self, seq: Sequence) -> None:
        self.drafter.on_verified(seq)
        state = self._choices.get(seq.seq_id)
        if state is None or state.pending is None:
            return
        way, accepted_before, forwards = state.pending
        state.ways[way].update(seq.spec.num_accepted_tokens - accepted_before + 1, forwards)
        state.pending = None

    def forget(self, seq: Sequence) -> None:
        self.drafter.forget(seq)
        self._choices.pop(seq.seq_id, None)


def _smooth(average: float | None, value: float) -> float:
    return value if average is None else average + SMOOTHING * (value - average)


def _trees(parents: list[list[int] | None]) -> list[list[int] | None] | None:
    return parents if any(p is not None for p in parents) else None
