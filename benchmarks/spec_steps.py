"""Where a speculative engine's time goes, step by step, against speculation off in the same run.

    python benchmarks/spec_steps.py --dataset ../shared/data/specbench_dev.jsonl \
        --category writing --proposers default hybrid:k=4,min=2,conf=0.5 [--batch 4]

For each engine (speculation off, then each proposer, specs as in ``spec_decode.py``) the
category's prompts are generated greedily one at a time (batch 1; ``--batch N``: N at once,
the prompts cycled) after a warm-up run, and every step is recorded: the way and number of
drafts its plan gave (the controller's, or ``fixed`` with the number the proposer made; with
a batch, the drafts of all its sequences, grouped as ``batch``), the tokens it emitted and its
wall time. Printed per engine: steps, seconds, the mean time a step spends in the speculator's
plan / propose / verify, in the controller's plan (part of plan) and in the target's forward,
and the host time (the step's time outside the forward and the proposer), then per (way,
drafts) group the steps, ms per step, tokens per step and ms per token. Outputs are identical
across engines (greedy), so step counts and times compare equal work. ``--passes N`` runs the
prompts N times on the same engines (each pass: every engine's run, one after another) and
reports each pass. It explains a gap between two configurations; ``spec_decode.py``
measures it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.code_edit_prompt import CODE_EDIT_PROMPTS
from benchmarks.common import Prompt, load_specbench, print_conditions
from benchmarks.spec_decode import proposer_config
from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.spec_decode.speculator import Speculator

PARTS = ("plan", "propose", "verify", "controller")


def timed(owner: Any, name: str, totals: dict[str, float], key: str | None = None) -> None:
    """Wrap ``owner.name`` so that its time adds to ``totals[key or name]``."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key or name] += time.perf_counter() - start

    setattr(owner, name, wrapped)


def instrument(engine: LLMEngine, totals: dict[str, float], verdicts: list[tuple]) -> None:
    """Time the speculator's parts and the forward; record each sequence's verdict."""
    speculator = engine.speculator
    for part in ("plan", "propose", "verify"):
        timed(speculator, part, totals)
    if speculator.controller is not None:  # the plan's own time, inside the speculator's
        timed(speculator.controller, "plan", totals, "controller")
    if engine.scheduler.draft_planner is not None:  # bound before the wrapper existed
        engine.scheduler.draft_planner = speculator.plan
    timed(engine.runner, "forward", totals)
    on_verified = speculator.on_verified

    def record(seq: Any, num_drafts: int, num_accepted: int, depth: int | None = None) -> None:
        choice = speculator._plan.get(seq.seq_id)
        if speculator.controller is None:
            verdicts.append(("fixed" if num_drafts else None, num_drafts, num_accepted))
        else:
            way = choice.way if choice is not None else None
            verdicts.append((way, choice.drafts if choice else 0, num_accepted))
        on_verified(seq, num_drafts, num_accepted, depth)

    speculator.on_verified = record  # type: ignore[method-assign]


class Recorder:
    """An engine instrumented once: part times and the verdicts of the current step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.totals: dict[str, float] = defaultdict(float)
        self.verdicts: list[tuple] = []
        instrument(engine, self.totals, self.verdicts)


def run(
    recorder: Recorder, prompts: list[list[int]], max_tokens: int, batch: int
) -> dict[str, Any]:
    """The prompts one at a time (``batch`` 1) or ``batch`` at once, cycled."""
    engine, totals, verdicts = recorder.engine, recorder.totals, recorder.verdicts
    totals.clear()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    steps: list[tuple[tuple, float, float, float, int]] = []
    outputs: dict[str, list[int]] = {}
    groups = [[p] for p in prompts] if batch == 1 else [(prompts * batch)[:batch]]
    for g, group in enumerate(groups):
        for i, prompt in enumerate(group):
            engine.add_request(f"steps-{g:03d}-{i:03d}-{time.monotonic_ns()}", prompt, params)
        while engine.has_unfinished_requests():
            verdicts.clear()
            forward, propose = totals["forward"], totals["propose"]
            start = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id.rsplit("-", 1)[0]] = list(out.outputs[0].token_ids)
            elapsed = time.perf_counter() - start
            if not verdicts:
                verdict: tuple = ("prompt", 0, -1)
            elif batch == 1:
                verdict = verdicts[0]
            else:  # the batch's drafts and accepted drafts, summed
                drafted = sum(v[1] for v in verdicts)
                verdict = ("batch" if drafted else None, drafted, sum(v[2] for v in verdicts))
            sampled = len(verdicts)  # sequences that emitted a token (none: a prompt chunk)
            forwarded, proposed = totals["forward"] - forward, totals["propose"] - propose
            steps.append((verdict, elapsed, forwarded, proposed, sampled))
    return {
        "steps": steps,
        "totals": dict(totals),
        "outputs": [outputs[k] for k in sorted(outputs)],
    }


def report(name: str, result: dict[str, Any]) -> None:
    steps, totals = result["steps"], result["totals"]
    seconds = sum(step[1] for step in steps)
    host = seconds - sum(forward + proposed for _, _, forward, proposed, _ in steps)
    parts = ", ".join(
        f"{part} {1000 * totals.get(part, 0.0) / len(steps):.2f}" for part in (*PARTS, "forward")
    )
    print(
        f"{name}: {len(steps)} steps, {seconds:.2f} s, ms per step: {parts}, "
        f"host {1000 * host / len(steps):.2f}"
    )
    groups: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for (way, drafts, accepted), dt, forward, _, sampled in steps:
        group = groups[(way, drafts)]
        group[0] += 1
        group[1] += dt
        group[2] += forward
        group[3] += max(accepted, 0) + sampled
    for (way, drafts), (count, total, fwd, tokens) in sorted(
        groups.items(), key=lambda g: -g[1][0]
    )[:12]:
        print(
            f"  {way!s:>8} x{drafts:<2} steps {count:4d}  ms/step {1000 * total / count:6.1f} "
            f"(forward {1000 * fwd / count:5.1f})  tokens/step {tokens / count:4.2f}  "
            f"ms/token {1000 * total / max(tokens, 1):6.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--category", required=True, help="a Spec-Bench category or code_editing")
    parser.add_argument("--proposers", nargs="+", default=["default"])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="sequences at once (cycled)")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--draft-confidence", type=float, default=0.0)
    parser.add_argument("--adaptive-k", action="store_true")
    parser.add_argument(
        "--passes", type=int, default=1, help="runs over the prompts, each engine in turn per pass"
    )
    args = parser.parse_args()

    common: dict[str, Any] = {
        "max_model_len": 2048,
        "max_num_seqs": args.batch,
        "enable_prefix_caching": False,
    }
    engines = {"off": LLMEngine(EngineConfig(**common, speculative_config={"method": "off"}))}
    for spec in args.proposers:
        config = proposer_config(spec, args)
        engines[spec] = LLMEngine(EngineConfig(**common, speculative_config=config))
    texts = [Prompt(t, "code_editing") for t in CODE_EDIT_PROMPTS] + load_specbench(
        args.dataset, None
    )
    tokenizer = engines["off"].tokenizer
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": p.text}])[1]
        for p in texts
        if p.category == args.category
    ][: args.prompts]
    if not prompts:
        raise SystemExit(f"no prompts of category {args.category!r}")
    print_conditions(
        "per-step breakdown of speculative decoding (greedy)",
        batch=args.batch,
        category=args.category,
        prompts=len(prompts) if args.batch == 1 else min(len(prompts), args.batch),
        max_tokens=args.max_tokens,
        proposers=args.proposers,
        speculator=Speculator.__module__,
    )
    recorders = {name: Recorder(engine) for name, engine in engines.items()}
    for recorder in recorders.values():  # warm-up
        run(recorder, prompts[:1], 8, 1)
    for p in range(args.passes):  # the same engines again: what they learned carries over
        results = {n: run(r, prompts, args.max_tokens, args.batch) for n, r in recorders.items()}
        base = sum(step[1] for step in results["off"]["steps"])
        if args.passes > 1:
            print(f"-- pass {p + 1} of {args.passes}")
        for name, result in results.items():
            same = result["outputs"] == results["off"]["outputs"]
            report(name, result)
            seconds = sum(step[1] for step in result["steps"])
            print(
                f"  speedup over off x{base / seconds:.2f}" + ("" if same else "  OUTPUT DIFFERS")
            )


if __name__ == "__main__":
    main()
