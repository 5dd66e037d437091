"""Every tunable constant of speculation's control and drafting, in one frozen object.

A field is here because a measurement says it matters; each says what it trades and which
measurement set it (the numbers are in ``docs/notes.md``). Pass another through
``SpeculativeConfig(tuning=...)`` (or ``speculative_config={"tuning": {...}}``) to experiment:
an experiment changes a field of a config, never an attribute of a live object. A fix replaces
a knob or a branch; it does not add one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from specbatch.errors import ConfigError


@dataclass(frozen=True)
class SpeculationTuning:
    """The goodput controller's, its step-time and acceptance models' and the proposers'
    constants (see the module docstring)."""

    # The numbers: the default's and each field's "without" (mechanism off, or folded into its
    # neighbour) over {"method": "off"}, batch 1, a 2-core AVX2 host, in docs/notes.md
    # (2026-12-05: "every tuning field with and without", "... across the categories").

    # -- the controller
    # A plan with drafts must beat the plain step by this share of its own estimate: the
    # estimates err, and the sequences drafted are those whose estimates run high (0: 1.44x
    # against 1.48x over four categories, three below the default and one level).
    hurdle: float = 0.03
    # Every this many plans, one draft more than the plan chose (0: never), so that a drafted
    # step shape measured slow (another process had the cores) is measured again (0: 1.29x /
    # 1.00x against 1.49x / 1.11x on qa / writing).
    probe_every: int = 16

    # -- the step-time model (``control/step_times.py``)
    # Steps remembered (a bound on memory and on a fit's work; 64 measured level), and the
    # weight a step keeps per step since it ran: newer steps outweigh older ones of the same
    # shape, so a shape measured slow is soon remeasured (1, no ageing: 1.75x against 1.93x
    # after a CPU spell).
    step_window: int = 512
    step_age_decay: float = 0.995
    # A fit is reused for this many new samples (a batch-1 plan fits every draft position's
    # step each step: fitting them fresh cost 1.7 ms a plan against 0.7; 1: 1.44x / 1.10x
    # against 1.49x / 1.11x). 16 against 4, gguf on the AVX2 host, all 13 categories side by
    # side (docs/notes.md, "the plan's cost at batch 1"): batch 1 geomean 1.08x against 1.06x,
    # 12 categories up or level (writing 0.94x / 0.93x, stem 1.00x / 0.97x); batch 8 0.99x
    # both (a refit costs ~1 ms; at 4 refits were a third of a batch-1 plan's 0.78 ms).
    refit_every: int = 16
    # Width of the nearness kernel in log tokens and log sequences: how local a fit is
    # (0.35: 1.45x / 1.10x against 1.48x / 1.11x).
    bandwidth: float = 0.7
    # A single sequence's steps (where padded products make a CPU step flat to 4 rows) are
    # fitted with a kernel this wide in log tokens, so that a step of 2 tokens is judged by
    # steps of 1-3 (the kink on the AVX-512 host). Settled there (Intel AVX-512/AMX, gguf,
    # batch 1, all 13 dev categories side by side, 2026-12-07): 0.15 1.22x geomean against
    # 1.19x with 0.7, 8 categories up or level; the kinked clocks of three controller tests
    # plan 3-5% below their optimum with 0.7. (On the AVX2 host, without the kink, 0.7 ran
    # 1.58x against 1.48x over four categories.)
    small_bandwidth: float = 0.15
    # A step timed with a share of the cores below ``contended_share`` of the usual (the
    # window's ``contention_quantile``: most steps', so a loaded machine's usual is its own)
    # informs a fit only where nothing else is known (another process had the cores; after a
    # CPU spell 0: 1.66x, the median step's share: 1.63x, against 1.93x).
    contended_share: float = 0.85
    contention_quantile: float = 0.9

    # -- the acceptance model (``control/acceptance.py``)
    # A sequence keeps this much of a bursty way's history per outcome (a lookup is right
    # through a copied span, then not; 0.97: 1.42x against 1.48x on qa) ...
    sequence_decay: float = 0.9
    # ... and of a steady way's (a draft model's rate is the text's), per outcome; every
    # estimate keeps this much per step without an outcome, drifting back to its prior (0.9:
    # 1.47x / 1.10x against 1.48x / 1.11x, level: the one decay of idle drift).
    steady_decay: float = 0.97
    # The rates shared by all sequences (a way's population, per position) keep this much
    # per outcome, the calibration sums per verify and per step (0.97: 1.44x against 1.48x
    # over four categories, each below the default).
    shared_decay: float = 0.99
    # Pseudo-outcomes behind every estimate, at its prior (a sequence's: its population's
    # rate; a population's and a position's: 0.5; calibration: a factor of 1; 1: 1.42x
    # against 1.48x on qa).
    prior_weight: float = 4.0

    # -- the proposers
    # Branching of draft trees: children per node looked at (a dynamic tree's; a chain's
    # siblings and sibling slots), occurrences a lookup tree follows (1, chains only: 1.56x /
    # 1.19x against 1.49x / 1.11x at batch 1, 1.10x / 0.99x against 1.13x / 0.98x at batch 8;
    # set on an AVX-512 BF16 host, where trees paid).
    tree_width: int = 4
    # The store of other requests' tokens (``proposers/suffix.py``): the shortest match it
    # looks up (its index's key), the longest it compares, and the latest occurrences of a
    # key it follows (the branches of its tries).
    suffix_key: int = 2
    suffix_match: int = 16
    suffix_occurrences: int = 32

    def __post_init__(self) -> None:
        for name in ("hurdle", "bandwidth", "small_bandwidth", "prior_weight"):
            _check(name, getattr(self, name), float, low=0.0, open_low=name != "hurdle")
        _check("probe_every", self.probe_every, int, low=0)
        for name in (
            "step_window",
            "refit_every",
            "tree_width",
            "suffix_key",
            "suffix_match",
            "suffix_occurrences",
        ):
            _check(name, getattr(self, name), int, low=1)
        for name in (
            "contended_share",
            "contention_quantile",
            "step_age_decay",
            "sequence_decay",
            "steady_decay",
            "shared_decay",
        ):
            _check(name, getattr(self, name), float, low=0.0, high=1.0)

    @classmethod
    def parse(cls, value: SpeculationTuning | Mapping[str, Any] | None) -> SpeculationTuning:
        """Accept a tuning, a dict of some of its fields, or None (the defaults)."""
        return parse_dataclass(cls, value, "speculative_config tuning")


Config = TypeVar("Config")


def parse_dataclass(cls: type[Config], value: object, what: str) -> Config:
    """``value`` as a ``cls`` (a dataclass): itself, a dict of some of its fields (each
    checked by its ``__post_init__``), or None for its defaults; a ``ConfigError`` naming
    ``what`` otherwise, and naming any unknown key."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a dict, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown {what} keys {unknown}; known: {sorted(known)}")
    return cls(**value)


def _check(
    name: str,
    value: object,
    kind: type,
    low: float,
    high: float | None = None,
    open_low: bool = False,
) -> None:
    """``value`` is a ``kind`` (an int counts as a float) within [low, high]."""
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        numeric = isinstance(value, int) and not isinstance(value, bool)
    bounds = f"({low}" if open_low else f"[{low}"
    bounds += f", {high}]" if high is not None else ", inf)"
    if (
        not numeric
        or value < low  # type: ignore[operator]
        or (open_low and value == low)
        or (high is not None and value > high)  # type: ignore[operator]
    ):
        raise ConfigError(f"tuning {name} must be a {kind.__name__} in {bounds}, got {value!r}")
