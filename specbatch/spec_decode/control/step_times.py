"""What a step costs, measured as the engine runs: the target's forward and a draft model's.

A CPU forward's time is not one function of its token count. At batch 1 the weights' memory
traffic dominates and four more rows are nearly free; at batch 64 the matmuls are compute-bound
and a verify row costs as much as a decode row; attention adds a term per (query row, cached
key) pair that grows with context; sampling and bookkeeping add one per sequence. So the
target's step time is fitted, near the composition asked about, as a linear function of its
tokens, its sequences and its attention pairs: a least-squares fit over the window of recent
steps (``SpeculationTuning.step_window``), weighted by age and by how close each was in tokens and
sequences (a Gaussian kernel in log space, ``bandwidth`` wide; in tokens ``small_bandwidth``
for a single sequence's steps, whose few rows sit on the padded products' kink). Close steps
decide the local slope; in the wide kernel far ones (prefills: many tokens, few sequences)
weigh ``FAR``, which separates the cost of a row from the cost of a sequence when every close
step had as many tokens as sequences. A draft model's forwards are fitted the same way on
their row count.

Contention: another process that takes the cores for a few seconds makes every step timed
meanwhile slow. On a CPU the engine measures it (``StepClock``): each step's share of the
cores (the process's CPU seconds over its wall seconds). A sample timed at a share below
``contended_share`` of the usual (the window's ``contention_quantile``, so that a loaded
machine's usual is its own) weighs ``FAR`` too: it informs a fit only where nothing else is
known, and a step timed on a free machine outweighs a spell's at once. Under lasting
contention every share is the usual one and nothing is weighed down.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from specbatch.spec_decode.tuning import SpeculationTuning

# The weight of a sample however far from the shape asked about, or timed contended: enough
# to fix a slope that no close step varies, never enough to move one that they do.
FAR = 1e-6
PAIR_SCALE = 1e-4  # attention pairs are fitted in units of 10^4 (the fit's conditioning)
CACHED_FITS = 64  # a fit memo's bound (a plan asks a dozen shapes at most; see _FitCache)
SLOPES = 3  # a step's fit has one per tokens, sequences, pairs: it needs as many samples
# The whisper of ridge on every fit's slopes: this share of the Gram matrix's trace, plus a floor
# (a column that does not vary gets slope 0, not noise)
RIDGE, RIDGE_FLOOR = 1e-9, 1e-30

Fit = TypeVar("Fit")
# a draft model's samples by row count: the counts, their weights, weighted seconds, least s/row
_Groups = tuple[list[float], list[float], list[float], float]


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

    def __init__(self, tuning: SpeculationTuning | None = None) -> None:
        self.tuning = tuning or SpeculationTuning()
        window = self.tuning.step_window
        # each step's row of the fit's design: 1, tokens, sequences, pairs (in PAIR_SCALE)
        self._design = np.zeros((window, 4))
        self._design[:, 0] = 1.0
        self._log = np.zeros((window, 2))  # log tokens, log sequences (for nearness)
        self._y = np.zeros(window)
        self._decodes = np.zeros(window, dtype=bool)  # steps of decodes only (``reach``)
        self._ring = _Ring(window, self.tuning)
        self._cache: _FitCache[Any] = _FitCache(self.tuning.refit_every)

    @property
    def ready(self) -> bool:
        return self._ring.count >= SLOPES

    def observe(
        self,
        tokens: int,
        seqs: int,
        pairs: float,
        seconds: float,
        share: float = 1.0,
        decodes: bool = True,
    ) -> None:
        """A step of ``tokens`` tokens of ``seqs`` sequences attending ``pairs`` pairs took
        ``seconds``, with ``share`` of the cores (CPU over wall seconds; 1.0 where unknown);
        ``decodes``: every sequence decoded (no prompt computed), so every token had logits."""
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        slot = self._ring.add(share)
        seqs = max(seqs, 1)
        self._design[slot, 1:] = (tokens, seqs, pairs * PAIR_SCALE)
        self._log[slot] = (math.log(tokens), math.log(seqs))
        self._y[slot] = seconds
        self._decodes[slot] = decodes

    def timed_near(self, tokens: float, seqs: float) -> bool:
        """Whether a step within one kernel width of ``tokens`` tokens and ``seqs`` sequences
        (in each, about 2x) was timed: else a fit there is an extrapolation from other shapes
        (after a batch of 64 prompts' prefill, a decode of those 64 was predicted at 1.9 s,
        its prefill's time, against 130 ms measured next)."""
        count = self._ring.count
        if not count:
            return False
        shape = ("near", tokens, seqs)  # a yes is kept as fits are (the scan: ~30 us)
        if self._cache.get(shape, count):
            return True
        point = (math.log(max(tokens, 1.0)), math.log(max(seqs, 1.0)))
        near = np.abs(self._log[self._ring.stored] - point).max(axis=1) <= self.tuning.bandwidth
        return bool(near.any()) and self._cache.put(shape, count, True)

    def reach(self, seqs: float) -> float:
        """The most tokens a step of ``seqs`` sequences' decodes may have and still be within
        one kernel width of a timed step of decodes (``timed_near``'s test, taken at its
        widest): beyond it a fit is an extrapolation. A plan drafts within it, so a new batch
        size's drafted shapes are measured growing about 2x a step, not guessed. Prompt steps
        do not count: their tokens have no logits, and on a large vocabulary a verify row's
        logits are most of its price (Gemma 3's 262k: after batch 1 and a batch-16 prefill
        had priced a row, 62-88 drafts a step at 4-5x the plain step's time; the default
        0.82x of off at 16)."""
        if not self._ring.count:
            return 0.0
        stored = self._ring.stored & self._decodes  # (each drafted step may widen it)
        near = np.abs(self._log[stored, 1] - math.log(max(seqs, 1.0))) <= self.tuning.bandwidth
        tokens = self._design[stored, 1][near]
        return float(tokens.max()) * math.exp(self.tuning.bandwidth) if tokens.size else 0.0

    def fit(self, tokens: float, seqs: float) -> StepCost:
        """The local linear model around a step of ``tokens`` tokens and ``seqs`` sequences."""
        return self.fits([tokens], seqs)[0]

    def fits(self, sizes: list[float], seqs: float) -> list[StepCost]:
        """``fit`` at each of ``sizes`` tokens, ``seqs`` sequences: as fitted within the
        last ``refit_every`` samples if every one was, else all of them again in one
        computation (a batch-1 plan asks for one per draft position every step; refitting
        only the missing ones put the sizes out of phase, two computations every
        ``refit_every`` plans where one does)."""
        count = self._ring.count
        if not count:
            return [StepCost(0.0, 0.0, 0.0, 0.0) for _ in sizes]
        cached = [self._cache.get((size, seqs), count) for size in sizes]
        if all(fit is not None for fit in cached):
            return cached  # type: ignore[return-value]
        return [
            self._cache.put((size, seqs), count, fit)
            for size, fit in zip(sizes, self._fit(sizes, seqs), strict=True)
        ]

    def _fit(self, sizes: list[float], seqs: float) -> list[StepCost]:
        prior = self._ring.weights()  # 0 where no step is stored yet
        design, y = self._design, self._y
        if seqs > 1:
            # every slope and the intercept >= 0 in the fit (see _weighted_fit); a fit's
            # negative slopes clamped after it took the fit off its own samples (pairs nearly
            # a multiple of tokens traded slopes as at batch 1): a batch-64 decode of 100 ms
            # predicted at 490 ms, every draft cheap against it (coding b=64 0.86x of off)
            weights = prior * (self._kernel(sizes, seqs, self.tuning.bandwidth) + FAR)
            return [
                StepCost(fixed, per_token, per_seq, per_pair * PAIR_SCALE)
                for fixed, per_token, per_seq, per_pair in _weighted_fits(design, y, weights, True)
            ]
        # One sequence: the narrow kernel in tokens leaves few close steps (those of one
        # size), whose attention pairs barely vary: a per-pair slope fitted on them is their
        # noise, and a row's price would extrapolate it to another context. The per-pair cost
        # of attention is one number whatever the step's size, so it is fitted on the wide
        # kernel around the plain step (decodes at every context), and the narrow one fits
        # the rest, all slopes >= 0 (see _weighted_fit).
        per_pair = self._cache.get(("pair", seqs), self._ring.count)
        if per_pair is None:
            per_pair = self._cache.put(
                ("pair", seqs), self._ring.count, self._pair_slope(prior, seqs)
            )
        kernel = self._kernel(sizes, seqs, self.tuning.small_bandwidth)
        # no floor: so narrow a kernel weighs a step two sizes away at ~1e-5, and far ones
        # (prefills) would bend its slope (the float's least positive value keeps the sums)
        weights = prior * np.maximum(kernel, np.finfo(float).tiny)
        fitted = _weighted_fits(design[:, :3], y - per_pair * design[:, 3], weights, True)
        return [
            StepCost(fixed, per_token, per_seq, per_pair * PAIR_SCALE)
            for fixed, per_token, per_seq in fitted
        ]

    def _kernel(self, sizes: list[float], seqs: float, token_bandwidth: float) -> np.ndarray:
        """Per size (sizes x samples), the Gaussian kernel of each step's (log tokens, log
        sequences) distance from (``size`` tokens, ``seqs`` sequences), ``token_bandwidth``
        wide in tokens and the wide bandwidth in sequences."""
        log = self._log
        tokens = np.log(np.maximum(sizes, 1.0))[:, None]
        in_tokens = ((log[None, :, 0] - tokens) / token_bandwidth) ** 2
        in_seqs = ((log[:, 1] - math.log(max(seqs, 1.0))) / self.tuning.bandwidth) ** 2
        return np.exp(-(in_tokens + in_seqs[None]) / 2)

    def _pair_slope(self, prior: np.ndarray, seqs: float) -> float:
        """The per-pair slope (in units of ``PAIR_SCALE`` pairs) of the wide, constrained
        fit around the plain step of ``seqs`` sequences."""
        weight = prior * (self._kernel([seqs], seqs, self.tuning.bandwidth)[0] + FAR)
        return float(_weighted_fit(self._design, self._y, weight, constrained=True)[3])


class ForwardTimes:
    """A draft model's forward times: rows -> seconds, fitted locally like the target's."""

    def __init__(self, tuning: SpeculationTuning | None = None) -> None:
        self.tuning = tuning or SpeculationTuning()
        window = self.tuning.step_window
        self._design = np.ones((window, 2))  # 1, rows
        self._y = np.zeros(window)
        self._ring = _Ring(window, self.tuning)
        self._cache: _FitCache[tuple[float, float]] = _FitCache(self.tuning.refit_every)
        self._grouped: tuple[int, _Groups] | None = None  # (sample count, its groups)

    @property
    def ready(self) -> bool:
        return self._ring.count > 0

    def observe(self, rows: int, seconds: float, share: float = 1.0) -> None:
        if rows <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        slot = self._ring.add(share)
        self._design[slot, 1], self._y[slot] = rows, seconds

    def fit(self, rows: float) -> tuple[float, float]:
        """(seconds per forward, seconds per row) near forwards of ``rows`` rows (fitted
        again every ``refit_every`` samples)."""
        count = self._ring.count
        if not count:
            return 0.0, 0.0
        cached = self._cache.get((rows,), count)
        if cached is None:
            cached = self._cache.put((rows,), count, self._fit(rows))
        return cached

    def _fit(self, rows: float) -> tuple[float, float]:
        values, priors, seconds, least_per_row = self._groups()
        wanted = math.log(max(rows, 1.0))
        nearness = [(math.log(v) - wanted) ** 2 for v in values]
        bandwidth = self.tuning.bandwidth
        if min(nearness) > (2 * bandwidth) ** 2:
            # nothing measured within two kernel widths (~4x the rows): a fit would put a far
            # forward's whole time (a prompt's catch-up) in its fixed part and a plan would
            # never try a small forward, so never learn better; the optimistic reading (all
            # of it per row) gets it tried
            return 0.0, least_per_row
        # a line's weighted least squares in closed form (``_weighted_fit``'s, its whisper of
        # ridge included), over the samples' distinct row counts (a handful: one-row
        # forwards, a chain's, a few catch-ups), each with its samples' summed weight and
        # weighted seconds: a catch-up's fit is asked at a new row count most steps the
        # draft model sits out, and numpy over the window's slots cost ~70 us a fit there
        kernels = [math.exp(-near / (2 * bandwidth**2)) + FAR for near in nearness]
        weights = [k * prior for k, prior in zip(kernels, priors, strict=True)]
        total = sum(weights)
        reach = sum(w * v for w, v in zip(weights, values, strict=True))  # sum of w * rows
        mean_r = reach / total
        timed = [k * y for k, y in zip(kernels, seconds, strict=True)]  # sum of w * y per count
        mean_y = sum(timed) / total
        spread = sum(w * (v - mean_r) ** 2 for w, v in zip(weights, values, strict=True))
        moment = sum(
            (v - mean_r) * (t - w * mean_y) for v, t, w in zip(values, timed, weights, strict=True)
        )
        per_row = moment / (spread * (1 + RIDGE) + RIDGE_FLOOR)
        fixed = mean_y - per_row * mean_r
        per_row = max(per_row, 0.0)
        if fixed < 0:  # a line through the origin's side: all of it per row
            fixed, per_row = 0.0, sum(timed) / reach
        return fixed, per_row

    def _groups(self) -> _Groups:
        """The stored samples by row count (computed once per new sample): the distinct row
        counts, per count its samples' summed weight before nearness and their weighted
        seconds, and the least seconds per row of any sample."""
        count = self._ring.count
        if self._grouped is None or self._grouped[0] != count:
            stored = self._ring.stored
            r, y = self._design[stored, 1], self._y[stored]
            values, index = np.unique(r, return_inverse=True)
            prior = self._ring.weights()[stored]
            priors = np.bincount(index, weights=prior, minlength=len(values))
            seconds = np.bincount(index, weights=prior * y, minlength=len(values))
            least = float((y / r).min())
            self._grouped = (count, (values.tolist(), priors.tolist(), seconds.tolist(), least))
        return self._grouped[1]


class _Ring:
    """The window's samples, a slot per step in turn, and each one's weight before nearness:
    its age's decay (``step_age_decay`` per sample since), times ``FAR`` for one timed
    contended (see the module docstring); 0 for slots not yet used. Computed when a fit asks,
    once per new sample, and shared by every fit until the next: a sample's arrival writes
    its own slot only (a whole-window decay each step cost ~30 us after a forward, which
    leaves the window's arrays out of cache)."""

    def __init__(self, window: int, tuning: SpeculationTuning) -> None:
        self._share = np.ones(window)  # the process's share of the cores at each sample
        self._number = np.zeros(window)  # each slot's sample number (0, 1, ...)
        self._stored = np.zeros(window, dtype=bool)
        self._tuning = tuning
        self.count = 0
        self._computed = -1
        self._weights = np.zeros(window)

    @property
    def stored(self) -> np.ndarray:
        return self._stored

    def add(self, share: float) -> int:
        """Store a sample's share of the cores; its slot in the ring."""
        slot = self.count % len(self._stored)
        self._share[slot] = share if share > 0 and math.isfinite(share) else 1.0
        self._number[slot] = self.count
        self._stored[slot] = True
        self.count += 1
        return slot

    def weights(self) -> np.ndarray:
        if self._computed != self.count and self.count:
            self._computed = self.count
            tuning = self._tuning
            ages = (self.count - 1) - self._number
            decay = np.where(self._stored, tuning.step_age_decay**ages, 0.0)
            shares = self._share[self._stored]
            bar = _quantile(shares, tuning.contention_quantile) * tuning.contended_share
            if shares.min() >= bar:  # nothing contended (the usual case): the decay alone
                self._weights = decay
            else:
                self._weights = np.where(self._share < bar, FAR, 1.0) * decay
        return self._weights


class _FitCache(Generic[Fit]):
    """Fits by exact shape, each reused until ``refit_every`` samples have arrived since it
    was fitted; at most ``CACHED_FITS`` of them (a memo: no fit depends on what it holds).
    When full, the stale entries go, then the oldest: a draft model that never runs gets
    no samples, so its fits never go stale, while each step asks one at a new row count
    (its catch-up's, growing), and a purge on every new shape had come to scan hundreds of
    entries a step at batch 8."""

    def __init__(self, refit_every: int) -> None:
        self.refit_every = refit_every
        self._fits: dict[tuple[Any, ...], tuple[int, Fit]] = {}

    def get(self, shape: tuple[Any, ...], count: int) -> Fit | None:
        cached = self._fits.get(shape)
        if cached is not None and count - cached[0] < self.refit_every:
            return cached[1]
        return None

    def put(self, shape: tuple[Any, ...], count: int, fit: Fit) -> Fit:
        fits = self._fits
        if shape not in fits and len(fits) >= CACHED_FITS:
            fits = {k: v for k, v in fits.items() if count - v[0] < self.refit_every}
            if len(fits) >= CACHED_FITS:
                del fits[next(iter(fits))]
            self._fits = fits
        fits[shape] = (count, fit)
        return fit


def _quantile(values: np.ndarray, q: float) -> float:
    """``np.quantile(values, q)`` (linear interpolation) by partial sort: a few microseconds
    where np.quantile takes tens, once per step."""
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    part = np.partition(values, (low, high))
    return float(part[low] + (part[high] - part[low]) * (position - low))


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
    return _weighted_fits(design, y, weight[None], constrained)[0]


def _weighted_fits(
    design: np.ndarray, y: np.ndarray, weights: np.ndarray, constrained: bool
) -> np.ndarray:
    """``_weighted_fit`` for each row of ``weights`` (fits x samples), in one computation."""
    totals = weights.sum(1)
    # sums about each fit's heaviest sample (exact zeros for a column that does not vary,
    # and no cancellation between large raw sums), then centred on the weighted means
    heaviest = np.argmax(weights, axis=1)
    x = design[None, :, 1:] - design[heaviest, None, 1:]
    dy = y[None, :] - y[heaviest, None]
    weighted = x * weights[:, :, None]
    sum_x = weighted.sum(1)
    sum_y = (weights * dy).sum(1)
    weighted_t = weighted.transpose(0, 2, 1)  # (batched products: einsum's cost 5x here)
    gram = weighted_t @ x
    gram -= sum_x[:, :, None] * sum_x[:, None, :] / totals[:, None, None]
    moment = (weighted_t @ dy[:, :, None])[:, :, 0] - sum_x * (sum_y / totals)[:, None]
    slopes = _ridge_solve(gram, moment, constrained)
    mean_x = sum_x / totals[:, None] + design[heaviest, 1:]
    intercepts = sum_y / totals + y[heaviest] - (mean_x * slopes).sum(1)
    below = np.flatnonzero(intercepts < 0) if constrained else ()
    if len(below):
        # no forward takes negative time: the optimum with the intercept >= 0 too has it at
        # 0 (the problem is convex and its optimum without that bound is past it), so the
        # slopes are refitted through the origin (every such fit in one computation).
        # Otherwise a few far steps (a fresh engine's prefills, a contended spell) can
        # extrapolate a small step below zero, and rows would be priced against a free step
        raw = design[None, :, 1:] * weights[below, :, None]
        raw_t = raw.transpose(0, 2, 1)
        slopes[below] = _ridge_solve(raw_t @ design[:, 1:], raw_t @ y, constrained)
        intercepts[below] = 0.0
    return np.concatenate([intercepts[:, None], slopes], axis=1)


def _ridge_solve(gram: np.ndarray, moment: np.ndarray, constrained: bool) -> np.ndarray:
    """Per fit (``gram``: fits x slopes x slopes), the slopes minimising ``x.G.x - 2 x.h``
    with a whisper of ridge on ``gram`` (in place), all >= 0 if ``constrained``."""
    columns = gram.shape[1]
    trace = np.trace(gram, axis1=1, axis2=2)
    gram += np.eye(columns)[None] * (RIDGE * trace + RIDGE_FLOOR)[:, None, None]
    slopes = np.linalg.solve(gram, moment[:, :, None])[:, :, 0]
    if constrained:
        negative = (slopes < 0).any(axis=1)
        if negative.any():
            slopes[negative] = _nonnegative_slopes(gram[negative], moment[negative])
    return slopes


def _nonnegative_slopes(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """Per fit, argmin over x >= 0 of x.G.x - 2 x.h: the best of the unconstrained optima on
    every set of free slopes that are all >= 0 (every fit's set at once)."""
    count, columns = moment.shape
    slopes = np.zeros((count, columns))
    best = np.zeros(count)  # the objective's decrease from all slopes 0 (always feasible)
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            index = list(subset)
            trial = np.zeros((count, columns))
            if size == 1:  # (a division: the solver's call costs more than the rest here)
                trial[:, index[0]] = moment[:, index[0]] / gram[:, index[0], index[0]]
            else:
                sub = gram[:, index][:, :, index]
                trial[:, index] = np.linalg.solve(sub, moment[:, index, None])[:, :, 0]
            decrease = (trial * moment).sum(1)  # = 2 x.h - x.G.x at the optimum
            better = (trial >= 0).all(1) & (decrease > best)
            best = np.where(better, decrease, best)
            slopes = np.where(better[:, None], trial, slopes)
    return slopes
