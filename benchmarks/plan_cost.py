"""What the goodput controller's plan costs per step, in the engine and replayed.

    python benchmarks/plan_cost.py --dataset ../shared/data/specbench_dev.jsonl \
        --category writing --batch 4

The default engine (auto) generates greedily for ``--batch`` prompts of the category at once
(cycled), after a batch-1 run of the same prompts (so the controller has learned what it would
have in ``spec_decode.py``'s order). That batch run keeps every plan's inputs (a copy of the
controller's state before it and its arguments); a second, identical batch run times every
plan where it runs, copying nothing (a copy just before a plan would warm the caches it reads).
Then every kept plan is replayed on a copy of its state: warm (one plan after another) and
cold (after a sweep over a buffer as large as the model's weights, as a forward leaves the
caches); the replayed choices must equal the engine's (a check that the replay is the plan,
not of a code change). Printed: the plans, how many drafted, the mean step of the timed run,
and the mean and median ms of a plan in the engine, replayed warm and replayed cold. A change
to the plan's code is measured by running this before and after it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.code_edit_prompt import CODE_EDIT_PROMPTS
from benchmarks.common import Prompt, load_specbench, print_conditions
from benchmarks.spec_decode import run
from specbatch import LLMEngine
from specbatch.config import EngineConfig
from specbatch.spec_decode.control.controller import GoodputController


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--category", required=True, help="a Spec-Bench category or code_editing")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    engine = LLMEngine(
        EngineConfig(
            max_model_len=2048, max_num_seqs=max(args.batch, 1), enable_prefix_caching=False
        )
    )
    controller = engine.speculator.controller
    if controller is None:
        raise SystemExit("the default engine has no controller")
    texts = [Prompt(t, "code_editing") for t in CODE_EDIT_PROMPTS] + load_specbench(
        args.dataset, None
    )
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": p.text}])[1]
        for p in texts
        if p.category == args.category
    ][: args.prompts]
    if not prompts:
        raise SystemExit(f"no prompts of category {args.category!r}")
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    print_conditions(
        "the controller's plan per step: in the engine, replayed warm and cold",
        model=engine.model_path.name,
        category=args.category,
        batch=args.batch,
        prompts=len(prompts),
        max_tokens=args.max_tokens,
        sweep_mib=weights >> 20,
    )
    kept: list[tuple[GoodputController, tuple, list[tuple[Any, int]]]] = []
    in_engine: list[float] = []
    keeping = False
    plan = controller.plan

    def timed_plan(*plan_args: Any) -> Any:
        if keeping:
            state = copy.deepcopy(controller.__dict__ | {"plan": None})
            inputs = copy.deepcopy(plan_args)
        start = time.perf_counter()
        choices = plan(*plan_args)
        seconds = time.perf_counter() - start
        if keeping:
            twin = GoodputController.__new__(GoodputController)
            twin.__dict__.update(state)
            del twin.__dict__["plan"]
            kept.append((twin, inputs, [(c.way, c.drafts) for c in choices]))
        else:
            in_engine.append(seconds)
        return choices

    controller.plan = timed_plan  # type: ignore[method-assign, assignment]
    for prompt in prompts:  # what the controller would have learned at batch 1 first
        run(engine, [prompt], args.max_tokens, 1)
    batch = (prompts * args.batch)[: args.batch]
    keeping = True
    run(engine, batch, args.max_tokens, args.batch)
    keeping = False
    timed_from = len(in_engine)
    started, steps = time.perf_counter(), engine.stats.num_steps
    run(engine, batch, args.max_tokens, args.batch)
    step_ms = 1000 * (time.perf_counter() - started) / max(engine.stats.num_steps - steps, 1)
    in_engine = in_engine[timed_from:]

    buffer = torch.ones(max(weights // 4, 1))

    def replay(cold: bool) -> tuple[list[float], int]:
        seconds, differ = [], 0
        for state, inputs, chosen in kept:
            twin, twin_inputs = copy.deepcopy(state), copy.deepcopy(inputs)
            if cold:
                buffer.add_(1.0)  # every byte of a weights-sized buffer through the caches
            start = time.perf_counter()
            choices = GoodputController.plan(twin, *twin_inputs)
            seconds.append(time.perf_counter() - start)
            differ += [(c.way, c.drafts) for c in choices] != chosen
        return seconds, differ

    warm, differ_warm = replay(cold=False)
    cold, differ_cold = replay(cold=True)
    if not kept or not in_engine:
        raise SystemExit("no plans: nothing was generated with drafts possible")
    drafted = sum(1 for k in kept if any(d for _, d in k[2]))
    print(f"plans {len(kept)}, drafting {drafted}; a step of the timed run {step_ms:.2f} ms")
    for name, values in (
        ("in the engine", in_engine),
        ("replayed warm", warm),
        ("replayed cold", cold),
    ):
        print(
            f"  {name:14s} mean {1000 * statistics.mean(values):.3f} ms, "
            f"median {1000 * statistics.median(values):.3f} ms"
        )
    if differ_warm or differ_cold:
        print(f"  REPLAYED CHOICES DIFFER in {differ_warm} warm / {differ_cold} cold plans")


if __name__ == "__main__":
    main()
