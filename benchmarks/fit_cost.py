"""What the controller's step-time fits cost, on a full window of batch-1 steps.

    python benchmarks/fit_cost.py [--calls 3000]

A ``StepTimes`` and a ``ForwardTimes`` are filled with 600 synthetic steps (batch-1 steps of
1-9 tokens, a draft model's forwards of 1-3 rows), then fitted directly, bypassing the fit
cache: a small-step fit with its per-pair slope refitted, one reusing it, a larger step's fit
(30-38 tokens of 4 sequences), a draft-forward fit, and one new sample with the per-sample
priors it invalidates. Printed: microseconds per call of each. Warm caches and no forward
between calls: in the engine a fit costs about twice this (``plan_cost.py``). Run it before
and after a change to ``spec_decode/step_times.py``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_conditions
from specbatch.spec_decode.control.step_times import ForwardTimes, StepTimes


def per_call(work: Callable[[int], object], calls: int) -> float:
    """Microseconds per call of ``work(i)``, after a tenth as many warm-up calls."""
    for i in range(calls // 10):
        work(i)
    start = time.perf_counter()
    for i in range(calls):
        work(i)
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    print_conditions("step-time fit cost", calls=args.calls, window="600 steps observed")
    rng = random.Random(0)
    times, drafts = StepTimes(), ForwardTimes()
    for _ in range(600):
        tokens = rng.randint(1, 9)
        seconds = 0.017 + 0.0003 * tokens * rng.uniform(0.9, 1.1)
        times.observe(tokens, 1, 200.0 * tokens, seconds)
        drafts.observe(rng.randint(1, 3), 0.002)

    def small_with_pair_slope(i: int) -> object:
        times._pair_cache = type(times._pair_cache)()
        return times._fit(1 + i % 9, 1)

    def observe(i: int) -> object:
        times.observe(3, 1, 600.0, 0.018)
        return times._priors.weights()

    results = {
        "small-step fit, per-pair slope refitted": small_with_pair_slope,
        "small-step fit": lambda i: times._fit(1 + i % 9, 1),
        "larger step's fit": lambda i: times._fit(30 + i % 9, 4),
        "draft-forward fit": lambda i: drafts._fit(1 + i % 3),
        "a new sample and its priors": observe,
    }
    for name, work in results.items():
        print(f"{name:>40}: {per_call(work, args.calls):7.1f} us")


if __name__ == "__main__":
    main()
