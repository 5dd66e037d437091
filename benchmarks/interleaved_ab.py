"""Two variants of the default configuration against speculation off, interleaved in one run.

    python benchmarks/interleaved_ab.py --dataset ../shared/data/specbench_dev.jsonl \
        --batch 1 --toggle learn_past_drafts [--repeats 2] [--categories writing qa]

On this shared machine the speed of plain decoding drifts by 10-15% between runs minutes apart
(speculation off measured 53 and 64 tok/s on the same writing prompts in one morning), so
two benchmark runs, one per code version, compare ratios taken on different machines. Here
both variants live in one process: a default engine with the speculator's boolean attribute
``--toggle`` set False (A) and one with it True (B), and per category (two dev prompts each,
the code-editing prompts as ``code_editing``; ``--batch`` at once, prompts cycled) each
repeat runs off, A and B in lockstep by tokens emitted (``spec_decode.run_lockstep``: the next
step is always that of the engine furthest behind, so the three cover the same tokens over
the same stretch of wall time), each variant's ratio taken to off's. Printed per category:
A's and B's mean ratio to off and B/A; then geometric means. Greedy, 128 new tokens.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.code_edit_prompt import CODE_EDIT_PROMPTS
from benchmarks.common import load_specbench, print_conditions
from benchmarks.spec_decode import run, run_lockstep
from specbatch import LLMEngine
from specbatch.config import EngineConfig


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--toggle", required=True, help="a boolean attribute of the Speculator")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--categories", nargs="*")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    print_conditions(
        "interleaved A/B of the default configuration",
        batch=args.batch,
        variants=f"A: speculator.{args.toggle} = False, B: True",
        repeats=args.repeats,
        max_tokens=args.max_tokens,
    )
    common = {
        "max_model_len": 2048,
        "max_num_seqs": max(args.batch, 2),
        "enable_prefix_caching": False,
    }
    off = LLMEngine(EngineConfig(**common, speculative_config={"method": "off"}))
    variant_a, variant_b = LLMEngine(EngineConfig(**common)), LLMEngine(EngineConfig(**common))
    for engine, value in ((variant_a, False), (variant_b, True)):
        if not isinstance(getattr(engine.speculator, args.toggle, None), bool):
            parser.error(f"the speculator has no boolean attribute {args.toggle!r}")
        setattr(engine.speculator, args.toggle, value)
    texts: dict[str, list[str]] = {}
    for prompt in load_specbench(args.dataset, args.categories, 2):
        texts.setdefault(prompt.category, []).append(prompt.text)
    if not args.categories or "code_editing" in args.categories:
        texts["code_editing"] = list(CODE_EDIT_PROMPTS)
    tokenizer = off.tokenizer
    warm = [tokenizer.encode_chat([{"role": "user", "content": "Hi"}])[1]]
    for engine in (off, variant_a, variant_b):
        run(engine, warm, 8, 1)
    means_a, means_b = [], []
    for category, prompts in sorted(texts.items()):
        ids = [tokenizer.encode_chat([{"role": "user", "content": t}])[1] for t in prompts]
        ids = (ids * (args.batch // len(ids) + 1))[: max(args.batch, len(ids))]
        ratios: dict[str, list[float]] = {"A": [], "B": []}
        for _ in range(args.repeats):
            results = run_lockstep(
                {"off": off, "A": variant_a, "B": variant_b}, ids, args.max_tokens, args.batch
            )
            for name in ("A", "B"):
                if results[name]["outputs"] != results["off"]["outputs"]:
                    raise SystemExit(f"{category}: variant {name}'s output differs from off's")
                ratios[name].append(results[name]["tok_s"] / results["off"]["tok_s"])
        mean_a, mean_b = statistics.mean(ratios["A"]), statistics.mean(ratios["B"])
        means_a.append(mean_a)
        means_b.append(mean_b)
        print(
            f"{category:>15} b={args.batch}: A x{mean_a:.3f}, B x{mean_b:.3f}, "
            f"B/A {mean_b / mean_a:.3f}",
            flush=True,
        )
    gm_a, gm_b = geometric_mean(means_a), geometric_mean(means_b)
    print(f"geometric mean: A x{gm_a:.3f}, B x{gm_b:.3f}, B/A {gm_b / gm_a:.3f}")


if __name__ == "__main__":
    main()
