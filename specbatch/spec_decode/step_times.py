"""What a step costs, measured as the engine runs: the target's forward and a draft model's.

A CPU forward's time is not one function of its token count. At batch 1 the weights' memory
traffic dominates and four more rows are nearly free; at batch 64 the matmuls are compute-bound
and a verify row costs as much as a decode row; attention adds a term per (query row, cached
key) pair that grows with context; sampling and bookkeeping add one per sequence. So the
target's step time is fitted, near the composition asked about, as a linear function of its
tokens, its sequences and its attention pairs: a least-squares fit over the recent steps,
weighted by how close each was in tokens and sequences (log scale) and by its age. Close
steps decide the local slope (the knee between memory- and compute-bound is respected); far
ones (prefills: many tokens, few sequences) still weigh a little, which separates the cost of a
row from the cost of a sequence when every close step had as many tokens as sequences.

A draft model's forwards are fitted the same way on their row count.

Contention: another process that takes the cores for a few seconds makes every step timed
meanwhile slow, and a shape is timed again only when a plan asks for it, so a spell's samples
priced drafting out of batch-1 plans for hundreds of steps after it (a drafted shape's only
samples were slow). On a CPU the engine measures it directly: each step's share of the cores
(the process's CPU seconds over its wall seconds; ~1.0 per thread on a free machine, half that
while two busy processes share two cores with it), and a sample taken at a share below
``CONTENDED`` of the usual one (a high quantile of the window's, so that a slow machine's
usual is its own) weighs much less in every fit (``CONTENTION_POWER``): a spell's samples
inform a fit while nothing else is known, and a step timed on a free machine outweighs them
at once (``benchmarks/contention.py``). Under lasting contention every share is the usual
one and nothing is weighed down.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

WINDOW = 512  # steps remembered
AGE_DECAY = 0.995  # weight of a step per step since it ran
BANDWIDTH = 0.7  # of the log-distance kernel, in tokens and in sequences
FLOOR = 1e-6  # weight of a step however far: enough to fix a slope no close step varies
# Steps of at most SMALL_STEP tokens (where padded products make a CPU step flat to 4 rows,
# then rise) are fitted with a kernel this narrow in tokens, so that a step of 2 tokens is
# judged by steps of 1..3 (and the floor shrunk to match); above, the wide kernel
SMALL_STEP = 16
SMALL_BANDWIDTH = 0.15
SMALL_FLOOR = 1e-9
PAIR_SCALE = 1e-4  # attention pairs are counted in units of 10^4
# a sample whose share of the cores is below CONTENDED times the usual (USUAL_QUANTILE of the
# window's shares) weighs (share / usual / CONTENDED) ** CONTENTION_POWER: at half the usual
# (two busy processes on two cores) 0.002, so that one step timed on a free machine outweighs
# a spell's samples of its shape; at 3/4 of it 0.2. On a free machine shares vary by a few
# percent (0.95-1.05 at batch 1, 0.98-1.01 at batch 64): no sample is weighed down
CONTENDED = 0.85
CONTENTION_POWER = 12
USUAL_QUANTILE = 0.9
MIN_STEPS = 3
REFIT_EVERY = 4  # steps a fit is reused for while the step's shape stays within ~10%
CACHE_WIDTH = 0.1  # of a cached fit's shape, in log tokens and log sequences
CACHE_SIZE = 64

Fit = TypeVar("Fit")
# a draft forward's fit is trusted only near a measured row count (log distance: ~4x)
EXTRAPOLATE = math.log(4.0)


@dataclass(frozen=True)
class StepCost:
    """A fitted local model: ``fixed + per_token * tokens + per_seq * seqs + per_pair *
    pairs`` seconds (``pairs``: query rows times the keys each attends to)."""

    fixed: float
    per_token: float
    per_seq: float
    per_pair: float

    def seconds(self, tokens: float, seqs: float, pairs: float) -> float:
        estimate = self.fixed + self.per_token * tokens + self.per_seq * seqs
        return max(estimate + self.per_pair * pairs, 1e-9)

    def row(self, context: float) -> float:
        """Seconds one more query row adds, attending to ``context`` keys."""
        return self.per_token + self.per_pair * context


class StepTimes:
    """The target's step times: (tokens, sequences, attention pairs) -> seconds."""

    def __init__(self, window: int = WINDOW) -> None:
        self._x = np.zeros((window, 3))  # tokens, seqs, pairs
        self._y = np.zeros(window)
        self._share = np.ones(window)  # the process's share of the cores (see the module)
        self._step = np.full(window, -1, dtype=np.int64)  # when each slot was measured
        self._count = 0
        self._clean = _Contention(self._share, self._step)
        self._cache: _FitCache[StepCost] = _FitCache()
        self._pair_cache: _FitCache[float] = _FitCache()

    def fit(self, tokens: float, seqs: float) -> StepCost:
        """The local linear model around a step of ``tokens`` tokens and ``seqs`` sequences
        (reused while one fitted within ~10% of that shape is at most ``REFIT_EVERY`` steps
        old: a fit costs ~100 us, a plan asks for one per draft position, and a decode step
        at batch 64 keeps its shape for many steps)."""
        return self._cache.get((tokens, seqs), self._count, lambda: self._fit(tokens, seqs))

    @property
    def ready(self) -> bool:
        return self._count >= MIN_STEPS

    def observe(
        self, tokens: int, seqs: int, pairs: float, seconds: float, share: float = 1.0
    ) -> None:
        """A step of ``tokens`` tokens of ``seqs`` sequences attending ``pairs`` pairs took
        ``seconds``, with ``share`` of the cores (CPU over wall seconds; 1.0 where unknown)."""
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        slot = self._count % len(self._y)
        self._x[slot] = (tokens, max(seqs, 1), pairs)
        self._y[slot] = seconds
        self._share[slot] = share if share > 0 and math.isfinite(share) else 1.0
        self._step[slot] = self._count
        self._count += 1

    def _fit(self, tokens: float, seqs: float) -> StepCost:
        used = self._step >= 0
        x, y = self._x[used], self._y[used]
        if not len(y):
            return StepCost(0.0, 0.0, 0.0, 0.0)
        age = self._count - 1 - self._step[used]
        clean = self._clean.weights(self._count)[used]
        design = np.column_stack([np.ones(len(y)), x[:, 0], x[:, 1], x[:, 2] * PAIR_SCALE])
        if tokens > SMALL_STEP:
            # larger steps keep the clamp: there its bias is on the dear side, and with the
            # fit unbiased the draft model was started at batch 8 and lost (humanities b=8
            # 0.91x, c 2.0: its catch-up on whole histories)
            weight = (
                clean * AGE_DECAY**age * (np.exp(-_nearness(x, tokens, seqs, BANDWIDTH)) + FLOOR)
            )
            fixed, per_token, per_seq, per_pair = _weighted_fit(design, y, weight, False)
            return StepCost(
                fixed, max(per_token, 0.0), max(per_seq, 0.0), max(per_pair, 0.0) * PAIR_SCALE
            )
        # Small steps: the narrow kernel in tokens leaves few close steps (at batch 1, those
        # of one size), whose attention pairs barely vary: a per-pair slope fitted on them is
        # their noise, and a row's price extrapolates it to another context (two warm-up
        # steps of 2 tokens at context ~60, 1 ms apart, priced a row at context 229 at 83 ms,
        # three decode steps, and the plan stopped drafting for good). The per-pair cost of
        # attention is one number whatever the step's size, so it is fitted on the wide
        # kernel around the plain step of ``seqs`` sequences (decodes at every context), and
        # the narrow one fits the rest, all slopes >= 0 (see _weighted_fit).
        per_pair = self._pair_cache.get(
            (seqs,), self._count, lambda: _pair_slope(x, y, design, clean * AGE_DECAY**age, seqs)
        )
        narrow = (
            clean
            * AGE_DECAY**age
            * (np.exp(-_nearness(x, tokens, seqs, SMALL_BANDWIDTH)) + SMALL_FLOOR)
        )
        fixed, per_token, per_seq = _weighted_fit(
            design[:, :3], y - per_pair * design[:, 3], narrow, constrained=True
        )
        return StepCost(fixed, per_token, per_seq, per_pair * PAIR_SCALE)


def _nearness(x: np.ndarray, tokens: float, seqs: float, token_bandwidth: float) -> np.ndarray:
    """Half the squared log-distance of each step's (tokens, sequences) from the shape asked
    about, in bandwidths (``token_bandwidth`` in tokens, ``BANDWIDTH`` in sequences)."""
    return (
        (np.log(x[:, 0] / max(tokens, 1.0)) / token_bandwidth) ** 2
        + (np.log(x[:, 1] / max(seqs, 1.0)) / BANDWIDTH) ** 2
    ) / 2


def _pair_slope(
    x: np.ndarray, y: np.ndarray, design: np.ndarray, prior: np.ndarray, seqs: float
) -> float:
    """The per-pair slope (in units of ``PAIR_SCALE`` pairs) of the wide, constrained fit
    around the plain step of ``seqs`` sequences (``prior``: each step's weight before
    nearness)."""
    weight = prior * (np.exp(-_nearness(x, seqs, seqs, BANDWIDTH)) + FLOOR)
    return float(_weighted_fit(design, y, weight, constrained=True)[3])


class ForwardTimes:
    """A draft model's forward times: rows -> seconds, fitted locally like the target's."""

    def __init__(self, window: int = WINDOW) -> None:
        self._rows = np.zeros(window)
        self._y = np.zeros(window)
        self._share = np.ones(window)
        self._step = np.full(window, -1, dtype=np.int64)
        self._count = 0
        self._clean = _Contention(self._share, self._step)
        self._cache: _FitCache[tuple[float, float]] = _FitCache()

    @property
    def ready(self) -> bool:
        return self._count > 0

    def observe(self, rows: int, seconds: float, share: float = 1.0) -> None:
        if rows <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        slot = self._count % len(self._y)
        self._rows[slot], self._y[slot], self._step[slot] = rows, seconds, self._count
        self._share[slot] = share if share > 0 and math.isfinite(share) else 1.0
        self._count += 1

    def fit(self, rows: float) -> tuple[float, float]:
        """(seconds per forward, seconds per row) near forwards of ``rows`` rows (reused like
        the target's: a plan asks for it every step, drafting or not, and while the draft
        model is not used nothing new is measured)."""
        return self._cache.get((rows,), self._count, lambda: self._fit(rows))

    def _fit(self, rows: float) -> tuple[float, float]:
        used = self._step >= 0
        r, y = self._rows[used], self._y[used]
        if not len(y):
            return 0.0, 0.0
        if np.abs(np.log(r / max(rows, 1.0))).min() > EXTRAPOLATE:
            # nothing measured near: a fit would put a far forward's whole time (a prompt's
            # catch-up) in its fixed part and a plan would never try a small forward, so
            # never learn better; the optimistic reading (all of it per row) gets it tried
            return 0.0, float((y / r).min())
        age = self._count - 1 - self._step[used]
        near = np.log(r / max(rows, 1.0)) ** 2
        clean = self._clean.weights(self._count)[used]
        weight = clean * AGE_DECAY**age * (np.exp(-near / (2 * BANDWIDTH**2)) + FLOOR)
        fixed, per_row = _weighted_fit(
            np.column_stack([np.ones(len(y)), r]), y, weight, constrained=False
        )
        per_row = max(per_row, 0.0)
        if fixed < 0:  # a line through the origin's side: all of it per row
            fixed, per_row = 0.0, float((weight * y).sum() / (weight * r).sum())
        return fixed, per_row


class _Contention:
    """Each stored sample's weight by the share of the cores it was timed with (see the
    module docstring), recomputed once per new sample."""

    def __init__(self, share: np.ndarray, step: np.ndarray) -> None:
        self._share, self._step = share, step
        self._count = -1
        self._weights = np.ones(len(share))

    def weights(self, count: int) -> np.ndarray:
        if count != self._count:
            self._count = count
            used = self._step >= 0
            usual = float(np.quantile(self._share[used], USUAL_QUANTILE)) if used.any() else 1.0
            ratio = self._share / (usual * CONTENDED)
            self._weights = np.minimum(ratio, 1.0) ** CONTENTION_POWER
        return self._weights


class _FitCache(Generic[Fit]):
    """Fits by shape (log buckets of ``CACHE_WIDTH``), each reused for ``REFIT_EVERY``
    observations."""

    def __init__(self) -> None:
        self._fits: dict[tuple[int, ...], tuple[int, Fit]] = {}

    def get(self, shape: tuple[float, ...], count: int, compute: Callable[[], Fit]) -> Fit:
        key = tuple(round(math.log(max(v, 1.0)) / CACHE_WIDTH) for v in shape)
        cached = self._fits.get(key)
        if cached is not None and count - cached[0] < REFIT_EVERY:
            return cached[1]
        if len(self._fits) > CACHE_SIZE:
            self._fits = {k: v for k, v in self._fits.items() if count - v[0] < REFIT_EVERY}
        fit = compute()
        self._fits[key] = (count, fit)
        return fit


def _weighted_fit(
    design: np.ndarray, y: np.ndarray, weight: np.ndarray, constrained: bool = True
) -> np.ndarray:
    """Weighted least squares, with every coefficient >= 0 if ``constrained``, a whisper of
    ridge on the slopes (a column that does not vary gets 0, not noise).

    The slopes are constrained in the fit, not clamped after it: near a batch-1 step the
    attention pairs are nearly a multiple of the tokens (rows times the context), and an
    unconstrained fit can trade a large per-token slope against a negative per-pair one whose
    sum is right; clamping the negative one afterwards leaves the large one alone and prices a
    nearly free row at a decode step's cost. With at most a few slopes the constrained optimum
    is found exactly by trying every set of free slopes (the optimum's positive slopes are the
    unconstrained fit on its own set) and keeping the best fit whose slopes are all >= 0.
    Columns are centred so the intercept is not penalised."""
    total = weight.sum()
    mean_x = (weight[:, None] * design).sum(0) / total
    mean_y = float((weight * y).sum() / total)
    centred = (design - mean_x)[:, 1:]
    root = np.sqrt(weight)[:, None]
    a = centred * root
    b = (y - mean_y) * root[:, 0]
    gram = a.T @ a
    gram += np.eye(gram.shape[0]) * (1e-9 * np.trace(gram) + 1e-30)
    moment = a.T @ b
    slopes = np.linalg.solve(gram, moment)
    if constrained and (slopes < 0).any():
        slopes = _nonnegative_slopes(gram, moment, slopes)
    intercept = mean_y - float(mean_x[1:] @ slopes)
    if constrained and intercept < 0:
        # no forward takes negative time: the optimum with the intercept >= 0 too has it at
        # 0 (the problem is convex and its optimum without that bound is past it), so the
        # slopes are refitted through the origin. Without it a few far steps (a fresh
        # engine's prefills and drafted steps, a CPU spell among them) extrapolated a
        # batch-1 decode step to -1.5 s, and a plan priced rows against a free step
        raw = design[:, 1:] * root
        gram = raw.T @ raw
        gram += np.eye(gram.shape[0]) * (1e-9 * np.trace(gram) + 1e-30)
        moment = raw.T @ (y * root[:, 0])
        slopes = np.linalg.solve(gram, moment)
        if (slopes < 0).any():
            slopes = _nonnegative_slopes(gram, moment, slopes)
        intercept = 0.0
    return np.concatenate([[intercept], slopes])


def _nonnegative_slopes(
    gram: np.ndarray, moment: np.ndarray, unconstrained: np.ndarray
) -> np.ndarray:
    """argmin over x >= 0 of x.G.x - 2 x.h: the best of the unconstrained optima on every
    set of free slopes that are all >= 0."""
    columns = gram.shape[0]
    # usually the negative slopes of the unconstrained fit are the zero ones: fit the rest and
    # accept it if it is optimal (all >= 0, and no zero slope would lower the objective)
    free = unconstrained >= 0
    if free.any():
        slopes = np.zeros(columns)
        slopes[free] = np.linalg.solve(gram[np.ix_(free, free)], moment[free])
        if (slopes >= 0).all() and (moment - gram @ slopes)[~free].max() <= 0:
            return slopes
    slopes = np.zeros(columns)
    best = 0.0  # the objective's decrease from all slopes 0 (which is always feasible)
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            index = list(subset)
            trial = np.linalg.solve(gram[np.ix_(index, index)], moment[index])
            if (trial < 0).any():
                continue
            decrease = float(trial @ moment[index])  # = 2 x.h - x.G.x at the subset's optimum
            if decrease > best:
                best, slopes = decrease, np.zeros(columns)
                slopes[index] = trial
    return slopes
