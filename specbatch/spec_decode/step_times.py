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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

WINDOW = 512  # steps remembered
AGE_DECAY = 0.995  # weight of a step per step since it ran
BANDWIDTH = 0.7  # of the log-distance kernel, in tokens and in sequences
FLOOR = 1e-6  # weight of a step however far: enough to fix a slope no close step varies
PAIR_SCALE = 1e-4  # attention pairs are counted in units of 10^4
MIN_STEPS = 3
REFIT_EVERY = 4  # steps a fit is reused for while the step's shape stays within ~10%
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
        self._step = np.full(window, -1, dtype=np.int64)  # when each slot was measured
        self._count = 0
        self._cached: tuple[float, float, int, StepCost] | None = None  # tokens, seqs, count

    def fit(self, tokens: float, seqs: float) -> StepCost:
        """The local linear model around a step of ``tokens`` tokens and ``seqs`` sequences
        (the last one while the shape is close and it is at most ``REFIT_EVERY`` steps old:
        a fit costs ~100 us, a decode step at batch 64 keeps its shape for many steps)."""
        cached = self._cached
        if (
            cached is not None
            and self._count - cached[2] < REFIT_EVERY
            and abs(math.log(max(tokens, 1.0) / cached[0])) < 0.1
            and abs(math.log(max(seqs, 1.0) / cached[1])) < 0.1
        ):
            return cached[3]
        cost = self._fit(tokens, seqs)
        self._cached = (max(tokens, 1.0), max(seqs, 1.0), self._count, cost)
        return cost

    @property
    def ready(self) -> bool:
        return self._count >= MIN_STEPS

    def observe(self, tokens: int, seqs: int, pairs: float, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        slot = self._count % len(self._y)
        self._x[slot] = (tokens, max(seqs, 1), pairs)
        self._y[slot] = seconds
        self._step[slot] = self._count
        self._count += 1

    def _fit(self, tokens: float, seqs: float) -> StepCost:
        used = self._step >= 0
        x, y = self._x[used], self._y[used]
        if not len(y):
            return StepCost(0.0, 0.0, 0.0, 0.0)
        age = self._count - 1 - self._step[used]
        near = np.log(x[:, 0] / max(tokens, 1.0)) ** 2 + np.log(x[:, 1] / max(seqs, 1.0)) ** 2
        weight = AGE_DECAY**age * (np.exp(-near / (2 * BANDWIDTH**2)) + FLOOR)
        design = np.column_stack([np.ones(len(y)), x[:, 0], x[:, 1], x[:, 2] * PAIR_SCALE])
        coef = _weighted_fit(design, y, weight)
        fixed, per_token, per_seq, per_pair = coef
        return StepCost(
            fixed, max(per_token, 0.0), max(per_seq, 0.0), max(per_pair, 0.0) * PAIR_SCALE
        )


class ForwardTimes:
    """A draft model's forward times: rows -> seconds, fitted locally like the target's."""

    def __init__(self, window: int = WINDOW) -> None:
        self._rows = np.zeros(window)
        self._y = np.zeros(window)
        self._step = np.full(window, -1, dtype=np.int64)
        self._count = 0

    @property
    def ready(self) -> bool:
        return self._count > 0

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        slot = self._count % len(self._y)
        self._rows[slot], self._y[slot], self._step[slot] = rows, seconds, self._count
        self._count += 1

    def fit(self, rows: float) -> tuple[float, float]:
        """(seconds per forward, seconds per row) near forwards of ``rows`` rows."""
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
        weight = AGE_DECAY**age * (np.exp(-near / (2 * BANDWIDTH**2)) + FLOOR)
        fixed, per_row = _weighted_fit(np.column_stack([np.ones(len(y)), r]), y, weight)
        per_row = max(per_row, 0.0)
        if fixed < 0:  # a line through the origin's side: all of it per row
            fixed, per_row = 0.0, float((weight * y).sum() / (weight * r).sum())
        return fixed, per_row


def _weighted_fit(design: np.ndarray, y: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Weighted least squares with a whisper of ridge on the slopes (a column that does not
    vary gets 0, not noise); columns are centred so the intercept is not penalised."""
    total = weight.sum()
    mean_x = (weight[:, None] * design).sum(0) / total
    mean_y = float((weight * y).sum() / total)
    centred = (design - mean_x)[:, 1:]
    root = np.sqrt(weight)[:, None]
    a = centred * root
    gram = a.T @ a
    gram += np.eye(gram.shape[0]) * (1e-9 * np.trace(gram) + 1e-30)
    slopes = np.linalg.solve(gram, a.T @ ((y - mean_y) * root[:, 0]))
    intercept = mean_y - float(mean_x[1:] @ slopes)
    return np.concatenate([[intercept], slopes])
