"""What a plan is made of and what it gives: the ways of drafting, a candidate sequence, its
choice, the price of a verify row, and the step's report (the values the controller's two
plan paths, ``controller`` and ``single``, and the planner share)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Way(str, Enum):
    """A way of drafting, and what it is: one that copies tokens that exist before the step
    (a prompt-lookup match, graded by its length; a match in the store of other requests'
    tokens, ``proposers/suffix.py``; a constraint's only continuation, its forced tokens) or
    one that makes its own (the draft network, an application's proposer). A copying way's
    drafts are point masses and cost its proposer nothing; forced ones are certain (the
    masked target gives them probability 1, so every controller plans them beside its
    proposer's ways). Its value is its name in stats and /metrics."""

    LOOKUP1 = "lookup1"  # a prompt-lookup match of 1 token, 2, 3 or more
    LOOKUP2 = "lookup2"
    LOOKUP3 = "lookup3"
    SUFFIX = "suffix"
    DRAFT = "draft"
    EXTERNAL = "external"
    FORCED = "forced"

    def __str__(self) -> str:  # its value, where a name is printed
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    @property
    def copies(self) -> bool:
        """Whether it copies tokens (a lookup's, the store's, forced) rather than makes them."""
        return self not in (Way.DRAFT, Way.EXTERNAL)

    @property
    def lookup(self) -> bool:
        """Whether it is the sequence's own prompt lookup (of some match length)."""
        return self in LOOKUP_WAYS

    @property
    def steady(self) -> bool:
        """Whether its acceptance holds over a text (a network's, an application's; forced
        tokens always are), rather than bursting with copied spans (a lookup's)."""
        return self in (Way.DRAFT, Way.EXTERNAL, Way.FORCED)


LOOKUP_WAYS = (Way.LOOKUP1, Way.LOOKUP2, Way.LOOKUP3)  # by match length: 1, 2, 3 or more
SUFFIX = Way.SUFFIX
DRAFT = Way.DRAFT
EXTERNAL = Way.EXTERNAL
FORCED = Way.FORCED


def lookup_way(match_length: int) -> Way:
    return LOOKUP_WAYS[min(match_length, len(LOOKUP_WAYS)) - 1]


@dataclass
class Candidate:
    """A sequence that samples this step and may get drafts.

    ``context``: keys its first draft row attends to; ``lookup``: what prompt lookup would
    draft (empty: no match) and ``lookup_n`` the matched suffix length; ``suffix``: what the
    store of other requests would (empty: no match, or no store)."""

    seq_id: int
    slots: int
    context: int
    lookup: list[int]
    lookup_n: int = 0
    catch_up: int = 1  # rows the draft model computes for it before its first draft
    forced: list[int] = field(default_factory=list)  # its constraint's only continuation
    suffix: list[int] = field(default_factory=list)

    def copied(self, way: Way) -> list[int] | None:
        """What a way that copies tokens (a lookup of the matched length, the store, a
        constraint's forced tokens) would draft; None for a way that drafts its own."""
        if not way.copies:
            return None
        return next((tokens for found, tokens in self.copies() if found == way), [])

    def copies(self) -> list[tuple[Way, list[int]]]:
        """Each way that copies something for it, with what (its lookup's way, the store,
        forced tokens): the one place that says which way copies which tokens."""
        found = [(lookup_way(self.lookup_n), self.lookup)] if self.lookup else []
        if self.suffix:
            found.append((SUFFIX, self.suffix))
        if self.forced:
            found.append((FORCED, self.forced))
        return found


@dataclass(frozen=True)
class Choice:
    way: Way | None  # None: no drafts
    drafts: int
    # accepted drafts expected, by the uncalibrated estimates it was chosen on, if the
    # proposer makes 1, 2, ... drafts
    expected: tuple[float, ...] = ()
    # the drafts the plan chose where a probe added one (``probe_every``); acceptance is
    # learned from those only: the probe's draft is one no plan would choose, and counted it
    # would pull the rate of its position down for the drafts plans do choose
    planned: int | None = None

    @property
    def learned(self) -> int:
        """The drafts acceptance is learned from (the planned ones)."""
        return self.drafts if self.planned is None else self.planned


@dataclass(frozen=True)
class PlanReport:
    """What the controller decided for a step, and why (for stats and /metrics)."""

    candidates: int = 0
    seqs_drafting: int = 0
    drafts: int = 0
    by_way: dict[Way, int] = field(default_factory=dict)
    step_seconds: float = 0.0  # estimated, before drafts
    row_seconds: float = 0.0  # estimated target cost of one more row, mean over candidates
    expected_gain: float = 1.0  # planned goodput over the no-draft step's


@dataclass(frozen=True)
class Prices:
    """What one more verify row costs a planned step: ``step`` seconds at the candidates'
    mean context plus ``per_pair`` per key beyond it, worth ``tokens_per_second`` (the plan's
    goodput; 0 where it was not planned on measured times)."""

    step: float = 0.0
    per_pair: float = 0.0
    mean_context: float = 0.0
    tokens_per_second: float = 0.0

    def row_seconds(self, context: float) -> float:
        """Seconds of one more verify row attending ``context`` keys."""
        return max(self.step + self.per_pair * (context - self.mean_context), 0.0)

    def row_tokens(self, context: float) -> float | None:
        """That row's cost in tokens at the plan's goodput (None: not planned on measured
        times)."""
        if self.tokens_per_second <= 0.0:
            return None
        return self.tokens_per_second * self.row_seconds(context)


@dataclass(frozen=True)
class ControllerPlan:
    """Each candidate's choice, what rows cost, and the report."""

    choices: list[Choice]
    prices: Prices = Prices()
    report: PlanReport = PlanReport()


def probe_free(by_draft_model: bool, position: int, catch_up: int) -> bool:
    """Whether draft ``position`` may be a probe: not a draft model's first where its catch-up
    goes beyond the one or two rows a sequence it drafted for last step has (the tokens of the
    steps it sat out: a forward of them all, to measure one row)."""
    return not (by_draft_model and position == 0 and catch_up > 2)


def report_of(
    candidates: list[Candidate],
    choices: list[Choice],
    base_seconds: float,
    prices: Prices,
    expected_gain: float,
) -> PlanReport:
    by_way: dict[Way, int] = {}
    for choice in choices:
        if choice.way is not None:
            by_way[choice.way] = by_way.get(choice.way, 0) + choice.drafts
    mean_context = sum(c.context for c in candidates) / len(candidates)
    return PlanReport(
        candidates=len(candidates),
        seqs_drafting=sum(1 for c in choices if c.drafts),
        drafts=sum(c.drafts for c in choices),
        by_way=by_way,
        step_seconds=float(base_seconds),
        row_seconds=prices.row_seconds(mean_context),
        expected_gain=float(expected_gain),
    )
