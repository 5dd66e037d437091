"""Two diagnostics of ``spec_decode.py``: where a step's time goes, and a CPU spell.

``--steps``: after every cell, each engine's steps of the cell's last repeat, split by the
parts of a step (the speculator's plan, the controller's share of it, the proposal, the
target's forward, verification, learning, and the rest: scheduling, sampling, bookkeeping),
then grouped by the way and number of drafts their plan gave: steps, ms per step, tokens per
step, ms per token. It explains a gap between two configurations; the cells measure it.

``--contention SECONDS``: how a fresh engine recovers from a CPU spell. The controller learns
what a step costs from the steps it times; a spell of contention (other processes taking the
cores for a few seconds) makes every step timed during it slow, and a drafted step's shape is
timed again only when a plan drafts it, so a spell can price drafting out of the plans until
those samples are measured again. Speculation off generates the prompts one at a time
(``--contention-runs`` runs, its median the baseline); then per proposer a fresh engine runs
them undisturbed (the control), and ``--repeats`` fresh engines each run them while one busy
process per core spins for the first SECONDS of their first measured run (after
``--clean-first`` undisturbed runs). Printed per run: tok/s and its ratio to off, the plans
that drafted, the mean price of a verify row in step times, and the smallest plain step the
controller predicted (a fit that degenerates under contention shows as ~0 ms); then the worst
and median ratio of the runs after the spell's (the control's: after its first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from benchmarks.lockstep import StepRecord, Timer, run
from specbatch import LLMEngine

PARTS = ("plan", "controller", "propose", "forward", "verify", "learn")
HOG = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"


def part_timers(engine: LLMEngine) -> dict[str, Timer]:
    """Timers on the parts of an engine's step (those it has)."""
    speculator = engine.speculator
    timers = {"forward": Timer(engine.runner, "forward")}
    if engine.scheduler.draft_planner is not None:  # the speculator's plan, bound at build
        timers["plan"] = Timer(engine.scheduler, "draft_planner")
    if speculator.controller is not None:
        timers["controller"] = Timer(speculator.controller, "plan")
    for part in ("propose", "verify", "learn"):
        timers[part] = Timer(speculator, part)
    return timers


def print_steps(name: str, steps: list[StepRecord], timers: dict[str, Timer]) -> None:
    """One engine's steps: ms per step in each part, then by (way, drafts)."""
    count = len(steps)
    seconds = sum(s.seconds for s in steps)
    parts = {p: timers[p].seconds for p in PARTS if p in timers}
    rest = seconds - sum(v for p, v in parts.items() if p != "controller")
    split = ", ".join(f"{p} {1000 * v / count:.2f}" for p, v in parts.items())
    rest_ms = 1000 * rest / count
    print(f"  {name}: {count} steps, {seconds:.2f} s; ms per step: {split}, rest {rest_ms:.2f}")
    groups: dict[tuple[str, int], list[StepRecord]] = defaultdict(list)
    for s in steps:
        groups[(s.way or "-", s.drafts)].append(s)
    for (way, drafts), group in sorted(groups.items(), key=lambda g: -len(g[1]))[:12]:
        total = sum(s.seconds for s in group)
        tokens = sum(s.tokens for s in group)
        print(
            f"    {way:>12} x{drafts:<3} steps {len(group):4d}  ms/step "
            f"{1000 * total / len(group):6.1f}  tokens/step {tokens / len(group):4.2f}  "
            f"ms/token {1000 * total / max(tokens, 1):6.1f}"
        )


def contention(
    make_engine: Callable[[str], LLMEngine],
    names: list[str],
    prompts: list[list[int]],
    args: argparse.Namespace,
) -> None:
    """The ``--contention`` scenario (module docstring) for each proposer in ``names``."""
    off = make_engine("off")
    run(off, prompts[:1], 8, 1)  # warm-up
    baseline = [run(off, prompts, args.max_tokens, 1) for _ in range(args.contention_runs)]
    reference = baseline[0]["outputs"]
    off_speed = statistics.median(r["tok_s"] for r in baseline)
    print(f"off: {off_speed:.1f} tok/s (median of {args.contention_runs} runs)")
    del off
    identical = True
    after: dict[tuple[str, str], list[float]] = defaultdict(list)
    trials = [("control", 0.0)] + [("spell", args.contention)] * args.repeats
    for trial, (label, spell) in enumerate(trials):
        for name in names:
            engine = make_engine(name)
            run(engine, prompts[:1], 8, 1)  # warm-up: what a fresh engine's first request sees
            runs = [run(engine, prompts, args.max_tokens, 1) for _ in range(args.clean_first)]
            hogs = [
                subprocess.Popen([sys.executable, "-c", HOG, str(spell)])
                for _ in range((os.cpu_count() or 1) if spell > 0 else 0)
            ]
            runs += [run(engine, prompts, args.max_tokens, 1) for _ in range(args.contention_runs)]
            for hog in hogs:
                hog.wait()
            print(f"{name}, {label}{f' {trial}' if hogs else ''}:")
            for k, result in enumerate(runs):
                identical &= result["outputs"] == reference
                if k > args.clean_first:
                    after[(name, label)].append(result["tok_s"] / off_speed)
                print(
                    f"  run {k} ({_when(k, args.clean_first, bool(hogs))}): "
                    + _contention_run(result, off_speed)
                )
            del engine
    for (name, label), ratios in after.items():
        print(
            f"{name}, {label}, runs after the first{' after the spell' if label == 'spell' else ''}"
            f": {min(ratios):.2f}x off at worst, median {statistics.median(ratios):.2f}x"
            f" ({len(ratios)} runs)"
        )
    print(f"outputs identical to off: {identical}")


def _when(k: int, clean_first: int, spell: bool) -> str:
    if not spell:
        return "undisturbed"
    if k < clean_first:
        return "before the spell"
    return "the spell's" if k == clean_first else "after the spell"


def _contention_run(result: dict[str, Any], off_speed: float) -> str:
    planned = [s for s in result["steps"] if s.planned]
    drafting = sum(1 for s in planned if s.drafts)
    timed = [s for s in planned if s.plain_seconds > 0]
    row_price = statistics.mean(s.row_seconds / s.plain_seconds for s in timed) if timed else 0
    smallest = 1000 * min((s.plain_seconds for s in timed), default=0.0)
    return (
        f"{result['tok_s']:.1f} tok/s ({result['tok_s'] / off_speed:.2f}x off), {drafting} of "
        f"{len(planned)} plans drafted, row price {row_price:.3f} steps, smallest plain step "
        f"predicted {smallest:.2f} ms"
    )
