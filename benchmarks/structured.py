"""Structured outputs: what a constraint costs and what its forced tokens give back.

Four measurements, each against a baseline measured in the same run (engines stepped in
lockstep, so a drift of the shared machine lands on both; greedy, so compared engines emit
the same tokens where they share a constraint):

1. mask time per token, p50 and p99 (each computed mask of a constrained run, speculation
   ``{"method": "off"}``), beside llguidance's own maskbench figure (~50 us p50);
2. constrained vs unconstrained tok/s, speculation ``{"method": "off"}``, at each
   ``--rate-batches`` (target >= 0.95x), the unconstrained run writing as many tokens per
   prompt as the constrained one (EOS ignored), so that the batch shrinks alike in both;
3. on a schema-extraction workload (prompts whose answers fill a JSON schema), the default
   speculation with a constraint's forced tokens drafted vs not drafted (the engine patched so
   that no constraint reports forced tokens): tokens per target forward at batch 1, tok/s at
   each ``--forced-batches`` (target >= 1.10x);
4. the default speculation vs ``{"method": "off"}`` under constraints, at each
   ``--spec-batches`` (never below 0.97x).

    python benchmarks/structured.py --json /tmp/structured.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.common import print_conditions, write_json
from benchmarks.lockstep import run_lockstep
from specbatch import LLMEngine, SamplingParams, StructuredOutputsParams
from specbatch.config import EngineConfig
from specbatch.structured import constraint as constraint_module

OFF: dict[str, Any] = {"method": "off"}
DEFAULT: dict[str, Any] | None = None  # speculation as it ships (the goodput controller)

PEOPLE = [
    ("Maria Lopez", 34, "Seville", "nurse", ["cycling", "painting"]),
    ("John Smith", 52, "Leeds", "carpenter", ["fishing"]),
    ("Aiko Tanaka", 28, "Osaka", "software engineer", ["climbing", "chess", "baking"]),
    ("Pierre Dubois", 45, "Lyon", "chef", ["wine", "jazz"]),
    ("Fatima Khan", 39, "Lahore", "teacher", ["poetry"]),
    ("Lars Nilsen", 61, "Bergen", "fisherman", ["sailing", "woodwork"]),
    ("Chen Wei", 23, "Chengdu", "student", ["basketball", "music"]),
    ("Olga Petrova", 47, "Kazan", "doctor", ["running", "opera", "gardening"]),
]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "occupation", "hobbies", "employed"],
    "additionalProperties": False,
}


def extraction_prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    """Chat prompts asking for a person's details as JSON, from short biographies."""
    prompts = []
    for i in range(count):
        name, age, city, job, hobbies = PEOPLE[i % len(PEOPLE)]
        text = (
            f"{name} is {age + i // len(PEOPLE)} years old and lives in {city}, where they work "
            f"as a {job}. In their free time they enjoy {' and '.join(hobbies)}."
        )
        ask = (
            "Extract the person's name, age, city, occupation, hobbies and whether they are "
            f"employed, as JSON.\n\nText: {text}"
        )
        _, ids = engine.tokenizer.encode_chat([{"role": "user", "content": ask}])
        prompts.append(ids)
    return prompts


def engine(model: str | None, speculative: dict[str, Any] | None, batch: int) -> LLMEngine:
    config: dict[str, Any] = {
        "speculative_config": speculative,
        "dtype": "float32",
        "max_model_len": 512,  # chat prompts of ~100 tokens and answers of at most 96
        "num_kv_blocks": max(64, batch * 20),
        "max_num_seqs": batch,
    }
    if model:
        config["model"] = model
    return LLMEngine(EngineConfig(**config))


def without_forced(target: LLMEngine) -> None:
    """No constraint of ``target`` reports forced tokens (so none are drafted)."""
    constraints = target.intake.constraints
    make = constraints.new

    def new(grammar: Any) -> Any:
        made = make(grammar)
        made.forced = list  # type: ignore[method-assign]
        return made

    constraints.new = new  # type: ignore[method-assign]


def mask_times(model: str | None, prompts_count: int, max_tokens: int) -> list[float]:
    """Seconds of every computed (not cached) mask of a constrained run at batch 16."""
    times: list[float] = []
    real = constraint_module.Constraint.mask

    def timed(self: Any, drafts: Any = ()) -> Any:
        cached = tuple(drafts) in self._masks
        start = time.perf_counter()
        try:
            return real(self, drafts)
        finally:
            if not cached:
                times.append(time.perf_counter() - start)

    constraint_module.Constraint.mask = timed  # type: ignore[method-assign]
    try:
        target = engine(model, OFF, 16)
        prompts = extraction_prompts(target, prompts_count)
        params = [constrained(max_tokens)] * len(prompts)
        run_lockstep({"off": target}, prompts, max_tokens, 16, {"off": params})
    finally:
        constraint_module.Constraint.mask = real  # type: ignore[method-assign]
    return times


def constrained(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )


def constrained_lengths(
    target: LLMEngine, prompts: list[list[int]], max_tokens: int, batch: int
) -> list[int]:
    """Each prompt's constrained output length (greedy: every run writes the same)."""
    run = run_lockstep(
        {"c": target}, prompts, max_tokens, batch, {"c": [constrained(max_tokens)] * len(prompts)}
    )
    return [len(ids) for ids in run["c"]["outputs"]]


def ratios(
    engines: dict[str, LLMEngine],
    prompts: list[list[int]],
    max_tokens: int,
    batch: int,
    params: dict[str, list[SamplingParams]],
    repeats: int,
) -> dict[str, dict[str, Any]]:
    """Median tok/s of each engine over ``repeats`` lockstep runs, and per run the tokens,
    steps and target forwards."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for _ in range(repeats):
        results = run_lockstep(engines, prompts, max_tokens, batch, params)
        for name, result in results.items():
            runs[name].append(result)
    summary = {}
    for name, results in runs.items():
        rates = [r["tok_s"] for r in results]
        steps = [len(r["steps"]) for r in results]
        summary[name] = {
            "tok_s": statistics.median(rates),
            "tok_s_runs": rates,
            "tokens": results[0]["tokens"],
            "steps": statistics.median(steps),
            "tokens_per_step": results[0]["tokens"] / statistics.median(steps),
            "outputs": results[0]["outputs"],
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate-batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--forced-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--spec-batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print_conditions(
        "structured outputs",
        model=args.model or "SmolLM2-135M-Instruct (default)",
        dtype="float32",
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        workload="schema extraction (6-field person schema, greedy, chat template)",
        settings="off = {'method': 'off'}; default = speculative_config None (as shipped)",
    )
    report: dict[str, Any] = {"conditions": vars(args)}

    times = np.array(mask_times(args.model, args.prompts, args.max_tokens)) * 1e6
    p50, p99 = np.percentile(times, [50, 99])
    print(f"mask time per token: p50 {p50:.0f} us, p99 {p99:.0f} us over {len(times)} masks")
    report["mask_us"] = {"p50": p50, "p99": p99, "count": len(times)}

    for batch in args.rate_batches:
        engines = {
            "unconstrained": engine(args.model, OFF, batch),
            "constrained": engine(args.model, OFF, batch),
        }
        prompts = extraction_prompts(engines["constrained"], args.prompts)
        # the unconstrained engine writes exactly as many tokens per prompt as the constrained
        # one (EOS ignored), so both batches shrink alike and only the masks' cost differs
        lengths = constrained_lengths(engines["constrained"], prompts, args.max_tokens, batch)
        params = {
            "unconstrained": [
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths
            ],
            "constrained": [constrained(args.max_tokens)] * len(prompts),
        }
        result = ratios(engines, prompts, args.max_tokens, batch, params, args.repeats)
        ratio = result["constrained"]["tok_s"] / result["unconstrained"]["tok_s"]
        print(
            f"b={batch:<3} off: constrained {result['constrained']['tok_s']:.1f} tok/s vs "
            f"unconstrained {result['unconstrained']['tok_s']:.1f} tok/s: x{ratio:.2f}"
        )
        report[f"rate_b{batch}"] = {
            k: {x: v[x] for x in ("tok_s", "tok_s_runs", "tokens")} for k, v in result.items()
        }

    for batch in args.forced_batches:
        engines = {
            "forced": engine(args.model, DEFAULT, batch),
            "no_forced": engine(args.model, DEFAULT, batch),
        }
        without_forced(engines["no_forced"])
        prompts = extraction_prompts(engines["forced"], args.prompts)
        params = {name: [constrained(args.max_tokens)] * len(prompts) for name in engines}
        result = ratios(engines, prompts, args.max_tokens, batch, params, args.repeats)
        assert result["forced"]["outputs"] == result["no_forced"]["outputs"]
        stats = engines["forced"].stats
        share = stats.num_forced_accepted_tokens / max(stats.num_generation_tokens, 1)
        ratio = result["forced"]["tok_s"] / result["no_forced"]["tok_s"]
        forced, plain = result["forced"], result["no_forced"]
        print(
            f"b={batch:<3} default: forced drafts {forced['tok_s']:.1f} tok/s "
            f"({forced['tokens_per_step']:.2f} tokens/step) vs without {plain['tok_s']:.1f} "
            f"tok/s ({plain['tokens_per_step']:.2f} tokens/step): x{ratio:.2f}; forced share "
            f"of the output {share:.0%}"
        )
        report[f"forced_b{batch}"] = {
            "ratio": ratio,
            "forced_share": share,
            **{
                k: {x: v[x] for x in ("tok_s", "tok_s_runs", "tokens_per_step")}
                for k, v in result.items()
            },
        }

    for batch in args.spec_batches:
        engines = {
            "off": engine(args.model, OFF, batch),
            "default": engine(args.model, DEFAULT, batch),
        }
        prompts = extraction_prompts(
            engines["off"], args.prompts if batch <= args.prompts else batch
        )
        params = {name: [constrained(args.max_tokens)] * len(prompts) for name in engines}
        result = ratios(engines, prompts, args.max_tokens, batch, params, args.repeats)
        assert result["off"]["outputs"] == result["default"]["outputs"]
        ratio = result["default"]["tok_s"] / result["off"]["tok_s"]
        print(
            f"b={batch:<3} constrained: default {result['default']['tok_s']:.1f} tok/s vs off "
            f"{result['off']['tok_s']:.1f} tok/s: x{ratio:.2f}"
        )
        report[f"spec_b{batch}"] = {
            "ratio": ratio,
            **{
                k: {x: v[x] for x in ("tok_s", "tok_s_runs", "tokens_per_step")}
                for k, v in result.items()
            },
        }
    write_json(args.json, report)


if __name__ == "__main__":
    main()
