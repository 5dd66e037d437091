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
import time
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


class StepClock:
    """A step's wall seconds and the process's share of the cores meanwhile (its CPU seconds
    over its wall seconds, on a CPU: what tells a step slowed by another process from a dear
    one; 1.0 on an accelerator, whose steps wait on the device)."""

    def __init__(self, on_cpu: bool) -> None:
        self.on_cpu = on_cpu
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()

    def read(self) -> tuple[float, float]:
        """(seconds, share) since the clock started."""
        seconds = time.perf_counter() - self.started
        if not self.on_cpu or seconds <= 0:
            return seconds, 1.0
        return seconds, (time.process_time() - self.cpu_started) / seconds


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
        # each step's row of the fit's design: 1, tokens, sequences, pairs (in PAIR_SCALE)
        self._design = np.zeros((window, 4))
        self._design[:, 0] = 1.0
        self._log = np.zeros((window, 2))  # log tokens, log sequences (for nearness)
        self._y = np.zeros(window)
        self._priors = _Priors(window)
        self._cache: _FitCache[StepCost] = _FitCache()
        self._pair_cache: _FitCache[float] = _FitCache()

    def fit(self, tokens: float, seqs: float) -> StepCost:
        """The local linear model around a step of ``tokens`` tokens and ``seqs`` sequences
        (reused while one fitted within ~10% of that shape is at most ``REFIT_EVERY`` steps
        old: a plan asks for one per draft position at batch 1, and a decode step at batch
        64 keeps its shape for many steps)."""
        return self._cache.get((tokens, seqs), self._priors.count, lambda: self._fit(tokens, seqs))

    @property
    def ready(self) -> bool:
        return self._priors.count >= MIN_STEPS

    def observe(
        self, tokens: int, seqs: int, pairs: float, seconds: float, share: float = 1.0
    ) -> None:
        """A step of ``tokens`` tokens of ``seqs`` sequences attending ``pairs`` pairs took
        ``seconds``, with ``share`` of the cores (CPU over wall seconds; 1.0 where unknown)."""
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        slot = self._priors.add(share)
        seqs = max(seqs, 1)
        self._design[slot, 1:] = (tokens, seqs, pairs * PAIR_SCALE)
        self._log[slot] = (math.log(tokens), math.log(seqs))
        self._y[slot] = seconds

    def _fit(self, tokens: float, seqs: float) -> StepCost:
        if not self._priors.count:
            return StepCost(0.0, 0.0, 0.0, 0.0)
        prior = self._priors.weights()  # 0 where no step is stored yet
        design, y = self._design, self._y
        if tokens > SMALL_STEP:
            # larger steps keep the clamp: there its bias is on the dear side, and with the
            # fit unbiased the draft model was started at batch 8 and lost (humanities b=8
            # 0.91x, c 2.0: its catch-up on whole histories)
            weight = prior * (np.exp(-self._nearness(tokens, seqs, BANDWIDTH)) + FLOOR)
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
            (seqs,), self._priors.count, lambda: self._pair_slope(prior, seqs)
        )
        narrow = prior * (np.exp(-self._nearness(tokens, seqs, SMALL_BANDWIDTH)) + SMALL_FLOOR)
        fixed, per_token, per_seq = _weighted_fit(
            design[:, :3], y - per_pair * design[:, 3], narrow, constrained=True
        )
        return StepCost(fixed, per_token, per_seq, per_pair * PAIR_SCALE)

    def _nearness(self, tokens: float, seqs: float, token_bandwidth: float) -> np.ndarray:
        """Half the squared log-distance of each step's (tokens, sequences) from the shape
        asked about, in bandwidths (``token_bandwidth`` in tokens, ``BANDWIDTH`` in
        sequences)."""
        log = self._log
        return (
            ((log[:, 0] - math.log(max(tokens, 1.0))) / token_bandwidth) ** 2
            + ((log[:, 1] - math.log(max(seqs, 1.0))) / BANDWIDTH) ** 2
        ) / 2

    def _pair_slope(self, prior: np.ndarray, seqs: float) -> float:
        """The per-pair slope (in units of ``PAIR_SCALE`` pairs) of the wide, constrained
        fit around the plain step of ``seqs`` sequences."""
        weight = prior * (np.exp(-self._nearness(seqs, seqs, BANDWIDTH)) + FLOOR)
        return float(_weighted_fit(self._design, self._y, weight, constrained=True)[3])


class ForwardTimes:
    """A draft model's forward times: rows -> seconds, fitted locally like the target's."""

    def __init__(self, window: int = WINDOW) -> None:
        self._design = np.ones((window, 2))  # 1, rows
        self._y = np.zeros(window)
        self._priors = _Priors(window)
        self._cache: _FitCache[tuple[float, float]] = _FitCache()

    @property
    def ready(self) -> bool:
        return self._priors.count > 0

    def observe(self, rows: int, seconds: float, share: float = 1.0) -> None:
        if rows <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        slot = self._priors.add(share)
        self._design[slot, 1], self._y[slot] = rows, seconds

    def fit(self, rows: float) -> tuple[float, float]:
        """(seconds per forward, seconds per row) near forwards of ``rows`` rows (reused like
        the target's: a plan asks for it every step, drafting or not, and while the draft
        model is not used nothing new is measured)."""
        return self._cache.get((rows,), self._priors.count, lambda: self._fit(rows))

    def _fit(self, rows: float) -> tuple[float, float]:
        if not self._priors.count:
            return 0.0, 0.0
        stored = self._priors.stored
        r, y = self._design[:, 1], self._y
        near = np.log(r / max(rows, 1.0)) ** 2  # stored rows are >= 1, the rest are 1
        if near[stored].min() > EXTRAPOLATE**2:
            # nothing measured near: a fit would put a far forward's whole time (a prompt's
            # catch-up) in its fixed part and a plan would never try a small forward, so
            # never learn better; the optimistic reading (all of it per row) gets it tried
            return 0.0, float((y[stored] / r[stored]).min())
        weight = self._priors.weights() * (np.exp(-near / (2 * BANDWIDTH**2)) + FLOOR)
        fixed, per_row = _weighted_fit(self._design, y, weight, constrained=False)
        per_row = max(per_row, 0.0)
        if fixed < 0:  # a line through the origin's side: all of it per row
            fixed, per_row = 0.0, float((weight * y).sum() / (weight * r).sum())
        return fixed, per_row


class _Priors:
    """The ring of stored samples: each one's weight before nearness, its age's decay times
    its contention weight (see the module docstring); 0 for slots not yet used. Computed
    once per new sample and shared by every fit until the next."""

    def __init__(self, window: int) -> None:
        self._share = np.ones(window)  # the process's share of the cores at each sample
        self._decay = np.zeros(window)  # AGE_DECAY ** age; 0 for slots not yet used
        self._stored = np.zeros(window, dtype=bool)
        self.count = 0
        self._computed = -1
        self._weights = self._decay

    @property
    def stored(self) -> np.ndarray:
        return self._stored

    def add(self, share: float) -> int:
        """Store a sample's share of the cores; its slot in the ring."""
        slot = self.count % len(self._stored)
        self._share[slot] = share if share > 0 and math.isfinite(share) else 1.0
        self._decay *= AGE_DECAY
        self._decay[slot] = 1.0
        self._stored[slot] = True
        self.count += 1
        return slot

    def weights(self) -> np.ndarray:
        if self._computed != self.count and self.count:
            self._computed = self.count
            shares = self._share[self._stored] if self.count < len(self._stored) else self._share
            bar = _quantile(shares, USUAL_QUANTILE) * CONTENDED
            if shares.min() >= bar:  # nothing contended (the usual case): the decay alone
                self._weights = self._decay
            else:
                clean = np.minimum(self._share / bar, 1.0) ** CONTENTION_POWER
                self._weights = clean * self._decay
        return self._weights


def _quantile(values: np.ndarray, q: float) -> float:
    """``np.quantile(values, q)`` (linear interpolation) by partial sort: a few microseconds
    where np.quantile takes tens, once per step."""
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    part = np.partition(values, (low, high))
    return float(part[low] + (part[high] - part[low]) * (position - low))


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
    Columns are centred so the intercept is not penalised (``design``'s first column is
    ones).

    ``weight`` may be 0 for rows that are not samples (the ring's unused slots)."""
    total = weight.sum()
    # sums about the heaviest sample (exact zeros for a column that does not vary, and no
    # cancellation between large raw sums), then centred on the weighted means
    heaviest = int(np.argmax(weight))
    x = design[:, 1:] - design[heaviest, 1:]
    dy = y - y[heaviest]
    weighted = x * weight[:, None]
    sum_x = weighted.sum(0)
    sum_y = float(weight @ dy)
    gram = weighted.T @ x - np.outer(sum_x, sum_x) / total
    moment = weighted.T @ dy - sum_x * (sum_y / total)
    slopes = _ridge_solve(gram, moment, constrained)
    mean_x = sum_x / total + design[heaviest, 1:]
    intercept = sum_y / total + y[heaviest] - float(mean_x @ slopes)
    if constrained and intercept < 0:
        # no forward takes negative time: the optimum with the intercept >= 0 too has it at
        # 0 (the problem is convex and its optimum without that bound is past it), so the
        # slopes are refitted through the origin. Without it a few far steps (a fresh
        # engine's prefills and drafted steps, a CPU spell among them) extrapolated a
        # batch-1 decode step to -1.5 s, and a plan priced rows against a free step
        raw = design[:, 1:] * weight[:, None]
        slopes = _ridge_solve(raw.T @ design[:, 1:], raw.T @ y, constrained)
        intercept = 0.0
    return np.concatenate([[intercept], slopes])


def _ridge_solve(gram: np.ndarray, moment: np.ndarray, constrained: bool) -> np.ndarray:
    """The slopes minimising ``x.G.x - 2 x.h`` with a whisper of ridge on ``gram`` (in
    place), all >= 0 if ``constrained``."""
    gram += np.eye(gram.shape[0]) * (1e-9 * np.trace(gram) + 1e-30)
    slopes = np.linalg.solve(gram, moment)
    if constrained and (slopes < 0).any():
        slopes = _nonnegative_slopes(gram, moment, slopes)
    return slopes


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
