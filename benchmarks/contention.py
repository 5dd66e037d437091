"""How the default configuration recovers from a CPU spell, against speculation off in the same run.

    python benchmarks/contention.py [--hogs 2] [--hog-seconds 3] [--runs 4] [--clean-first 0] \
        [--repeats 1]

The controller learns what a step costs from the steps it times. A spell of contention (other
processes taking the cores for a few seconds) makes every step timed during it slow, and a
drafted step's shape is timed only when a plan drafts it, so a spell can price drafting out of
the plans until those slow samples are measured again. This benchmark provokes one: a fresh
default engine generates the code-editing prompts at batch 1 (greedy, ``--max-tokens`` each),
``--runs`` times in a row, while ``--hogs`` busy processes take the cores for the first
``--hog-seconds`` seconds (``--clean-first N``: after N undisturbed runs, so the spell hits a
warmed model). A second fresh default engine runs the same prompts undisturbed (the control),
and speculation off runs them undisturbed (the baseline); ``--repeats N``: N fresh engines
each hit by a spell (where a spell lands among the steps varies). Printed per run: tokens per
second and its ratio to off's median, the steps the controller planned and how many drafted,
the mean price of a verify row in step times, and the smallest plain-step time the model
predicted (a fit that degenerates under contention shows as ~0 ms); then the worst and median
ratio to off of the runs after the spell's (the control's after its first). Outputs are
checked identical to off's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.code_edit_prompt import CODE_EDIT_PROMPTS
from benchmarks.common import print_conditions
from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig

HOG = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The prompts one at a time, greedily; per-step controller readings along the way."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    stats = engine.stats
    planned_before, drafting_before = stats.num_planned_steps, stats.num_drafting_steps
    outputs: list[list[int]] = []
    row_prices: list[float] = []
    plain_steps: list[float] = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"contention-{time.monotonic_ns()}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            planned = stats.num_planned_steps
            for out in engine.step():
                if out.finished:
                    outputs.append(list(out.outputs[0].token_ids))
            if stats.num_planned_steps > planned and stats.last_plan.step_seconds > 0:
                plain_steps.append(stats.last_plan.step_seconds)
                row_prices.append(stats.last_plan.row_seconds / stats.last_plan.step_seconds)
    seconds = time.perf_counter() - start
    return {
        "outputs": outputs,
        "tok_s": sum(len(o) for o in outputs) / seconds,
        "planned": stats.num_planned_steps - planned_before,
        "drafting": stats.num_drafting_steps - drafting_before,
        "row_price": statistics.mean(row_prices) if row_prices else 0.0,
        "min_plain_ms": 1000 * min(plain_steps) if plain_steps else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=2, help="busy processes in the spell")
    parser.add_argument("--hog-seconds", type=float, default=3.0)
    parser.add_argument("--runs", type=int, default=4, help="runs of the prompts after it")
    parser.add_argument("--clean-first", type=int, default=0, help="undisturbed runs before")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="fresh engines hit by a spell")
    args = parser.parse_args()
    print_conditions(
        "contention: the default configuration after a CPU spell, at batch 1",
        prompts=f"{len(CODE_EDIT_PROMPTS)} code-editing prompts, {args.max_tokens} new "
        "tokens each, greedy",
        spell=f"{args.hogs} busy processes for {args.hog_seconds} s at the start of the "
        f"first measured run, after {args.clean_first} undisturbed runs",
    )
    config = {"max_model_len": 2048, "max_num_seqs": 4, "enable_prefix_caching": False}
    off = LLMEngine(EngineConfig(**config, speculative_config={"method": "off"}))
    prompts = [
        off.tokenizer.encode_chat([{"role": "user", "content": text}])[1]
        for text in CODE_EDIT_PROMPTS
    ]
    generate(off, prompts[:1], 8)  # warm-up
    baseline = [generate(off, prompts, args.max_tokens) for _ in range(args.runs)]
    reference = baseline[0]["outputs"]
    off_speed = statistics.median(r["tok_s"] for r in baseline)
    print(f"off: {off_speed:.1f} tok/s (median of {args.runs} runs)")
    del off

    identical = True
    after: dict[str, list[float]] = {"control": [], "spell": []}
    trials = [("control", 0.0)] + [("spell", args.hog_seconds)] * args.repeats
    for trial, (label, hog_seconds) in enumerate(trials):
        engine = LLMEngine(EngineConfig(**config))  # the default: speculation on, controlled
        generate(engine, prompts[:1], 8)  # warm-up: what a fresh engine's first request sees
        runs = [generate(engine, prompts, args.max_tokens) for _ in range(args.clean_first)]
        hogs = [
            subprocess.Popen([sys.executable, "-c", HOG, str(hog_seconds)])
            for _ in range(args.hogs if hog_seconds > 0 else 0)
        ]
        runs += [generate(engine, prompts, args.max_tokens) for _ in range(args.runs)]
        for hog in hogs:
            hog.wait()
        print(f"{label}{f' {trial}' if hogs else ''}:")
        for k, run in enumerate(runs):
            identical &= run["outputs"] == reference
            if k > args.clean_first:
                after[label].append(run["tok_s"] / off_speed)
            when = (
                "undisturbed"
                if not hogs
                else "before the spell"
                if k < args.clean_first
                else "the spell's"
                if k == args.clean_first
                else "after the spell"
            )
            print(
                f"  run {k} ({when}): {run['tok_s']:.1f} tok/s "
                f"({run['tok_s'] / off_speed:.2f}x off), {run['drafting']} of "
                f"{run['planned']} plans drafted, row price {run['row_price']:.3f} steps, "
                f"smallest plain step predicted {run['min_plain_ms']:.2f} ms"
            )
        del engine
    for label, ratios in after.items():
        if ratios:
            print(
                f"{label}, runs after the first{' after the spell' if label == 'spell' else ''}"
                f": {min(ratios):.2f}x off at worst, median {statistics.median(ratios):.2f}x"
                f" ({len(ratios)} runs)"
            )
    print(f"outputs identical to off: {identical}")


if __name__ == "__main__":
    main()
