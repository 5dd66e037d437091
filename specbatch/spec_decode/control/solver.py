"""The exact optimum of a step's goodput over the drafts of each candidate (pure functions).

Per candidate, way and draft position the controller gives the chance a draft is emitted
(``gains``), the seconds it adds (``costs``) and whether it may be drafted (``valid``); a plan
takes one prefix of one way per candidate (or none). Its goodput is ``(seqs + sum of gains) /
(step seconds + sum of costs)``, the step's seconds depending on how deep the draft model's
forwards go (``bases[depth]``). ``best_by_depth`` maximises it exactly: Dinkelbach's method
per depth (for a trial ratio each candidate independently takes the prefix maximising
``gain - ratio * cost``; that choice's ratio is the next trial, until it stops rising), after
one pass over all depths finds those at which no plan can clear the floor. (A batch-1 step's
plan is ``single.plan_one``'s, the same optimum in plain floats.)
"""

from __future__ import annotations

import numpy as np

EPSILON = 1e-12  # relative: below it two goodputs are one (rounding)


def promising_depths(
    cum_gains: np.ndarray,
    cum_costs: np.ndarray,
    valid: np.ndarray,
    draft: int | None,
    bases: np.ndarray,
    seqs: int,
    floor: float,
) -> np.ndarray:
    """Per depth of the draft model's forwards (``bases``: the step's seconds with them),
    whether a plan of that depth can have a goodput above ``floor``: some choice of one
    prefix per candidate must be worth more than ``floor`` times its seconds by more than
    the plain part of the step falls short, ``sum(max(0, best prefix's gain - floor *
    cost)) > floor * base - seqs``. A depth that fails it fails at any higher ratio too (a
    prefix's value only falls as the ratio rises), so its solve would find nothing: one
    pass over all depths replaces a solve per depth (at larger batches, most steps' every
    depth). A depth allows the draft model's positions below it and every other way's."""
    values = np.where(valid, cum_gains - floor * cum_costs, -np.inf)
    if draft is None:
        per_depth = values.max(axis=(1, 2), initial=-np.inf)[:, None]
    else:
        rest = [w for w in range(values.shape[1]) if w != draft]
        others = values[:, rest].max(axis=(1, 2), initial=-np.inf)
        deeper = np.maximum.accumulate(values[:, draft], axis=1)
        per_depth = np.maximum(others[:, None], np.concatenate([others[:, None], deeper], 1))
    worth = np.maximum(per_depth, 0.0).sum(axis=0)
    # a hair of slack, so that rounding never skips a depth the solve would take
    return worth > (floor * bases - seqs) * (1 - 1e-9)


def best_by_depth(
    cum_gains: np.ndarray,
    cum_costs: np.ndarray,
    valid: np.ndarray,
    draft: int | None,
    bases: np.ndarray,
    seqs: int,
    floor: float,
) -> tuple[list[tuple[int, int]], float]:
    """The best plan above ``floor`` (else no drafts at ``floor``): per depth of the draft
    model's forwards that may pay (``bases[depth]``: the step's seconds with them), the
    exact optimum of the plans drafting no deeper with it."""
    best: tuple[list[tuple[int, int]], float] = ([(0, -1)] * seqs, floor)
    promising = promising_depths(cum_gains, cum_costs, valid, draft, bases, seqs, floor)
    if draft is not None and not valid[:, draft, 0].any():
        promising = promising[:1]  # no candidate may draft with the draft model
    for depth in np.flatnonzero(promising).tolist():
        allowed = valid
        if draft is not None:
            allowed = valid.copy()
            allowed[:, draft, depth:] = False
        chosen, ratio = dinkelbach(cum_gains, cum_costs, allowed, seqs, bases[depth], best[1])
        if ratio > best[1] * (1 + EPSILON):
            best = chosen, ratio
    return best


def dinkelbach(
    cum_gains: np.ndarray,
    cum_costs: np.ndarray,
    allowed: np.ndarray,
    seqs: int,
    base: float,
    floor: float,
) -> tuple[list[tuple[int, int]], float]:
    """The exact maximum of (seqs + chosen gains) / (base + chosen costs) over one prefix of
    one way per candidate (or none), if it exceeds ``floor`` (else ``floor`` and no drafts:
    starting the iteration at a higher ratio only skips plans that cannot beat it)."""
    count, _ways, depth = cum_gains.shape
    ratio = max(seqs / base, floor)
    best_choice = np.full(count, -1)
    rows = np.arange(count)
    flat_gains = cum_gains.reshape(count, -1)
    flat_costs = cum_costs.reshape(count, -1)
    flat_allowed = allowed.reshape(count, -1)
    while True:  # the ratio rises at every pass, through finitely many plans
        values = np.where(flat_allowed, flat_gains - ratio * flat_costs, -np.inf)
        index = values.argmax(axis=1)
        take = values[rows, index] > EPSILON * max(ratio, 1.0)
        choice = np.where(take, index, -1)
        gain = flat_gains[rows, index][take].sum()
        cost = flat_costs[rows, index][take].sum()
        new_ratio = (seqs + gain) / (base + cost)
        if new_ratio <= ratio * (1 + EPSILON):
            break
        ratio, best_choice = new_ratio, choice
    chosen = [(-1, -1) if i < 0 else divmod(int(i), depth) for i in best_choice]
    return [(w if d >= 0 else 0, d) for w, d in chosen], float(ratio)


def all_slots(gains: np.ndarray, valid: np.ndarray) -> list[tuple[int, int]]:
    """Every usable slot, of the way with the most expected tokens."""
    totals = np.where(valid, gains, 0.0).sum(axis=2)
    usable = valid.sum(axis=2)
    out = []
    for i in range(gains.shape[0]):
        w = int(totals[i].argmax())
        out.append((w, int(usable[i, w]) - 1))
    return out


def within_budget(
    chosen: list[tuple[int, int]], gains: np.ndarray, costs: np.ndarray, budget: int
) -> list[tuple[int, int]]:
    """Drop the least valuable last drafts until at most ``budget`` remain."""
    chosen = list(chosen)
    total = sum(d + 1 for _, d in chosen)
    while total > budget:
        worst = min(
            (i for i, (_, d) in enumerate(chosen) if d >= 0),
            key=lambda i: (
                gains[i, chosen[i][0], chosen[i][1]]
                / max(costs[i, chosen[i][0], chosen[i][1]], EPSILON)
            ),
        )
        way, last = chosen[worst]
        chosen[worst] = (way, last - 1)
        total -= 1
    return chosen
