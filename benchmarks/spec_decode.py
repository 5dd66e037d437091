"""Speculative decoding vs speculation off, per Spec-Bench category and batch size, same run.

    python benchmarks/spec_decode.py --dataset ../shared/data/specbench_dev.jsonl \
        --batch-sizes 1 4 8 16 32 64 --proposers default --code-edit --repeats 2

``default`` is what ``LLM()`` does without a speculative_config (auto: the goodput controller
choosing every step's drafts); ``ngram``, ``draft`` and ``hybrid`` are fixed-k unless given
``adaptive=1``; any field of ``SpeculationTuning`` is an option of every spec, so variants of
one configuration run side by side (``--proposers default default:hurdle=0,probe_every=0``).
Every cell runs its engines in lockstep by progress (``lockstep.run_lockstep``): the next
step is always that of the engine with the fewest tokens emitted so far, each engine's time
the sum of its own steps, so that all of them cover the same tokens over the same stretch of
wall time and the machine's drift (10-15% between runs minutes apart on this shared host)
lands on every engine alike (``--sequential``: each engine's run whole, one after another).
With ``--repeats`` every cell runs that many times and the speedup is the median of the
per-repeat ratios, printed with their range (the run-to-run spread). For the controller,
each row also prints the share of its planned steps that drafted, the drafts per planned
step, and the measured cost of one verify row over the step's (its step-time model at the
end of the cell).

For every category and batch size, each engine (speculation off, then each proposer) generates
greedily for the same chat-formatted first turns (plain text for a model with no chat template;
cycled to fill the batch), stopping at EOS or ``--max-tokens``; outputs are identical across
engines (greedy identity, checked: a row whose output differs says so), so tok/s compare equal
work. Reported per row: tok/s, speedup over off, mean accepted length (tokens per verify step,
bonus included), per-draft acceptance rate, and c, the measured cost of one draft step relative
to one speculation-off target step at that batch size (proposal time for n-gram).

Two diagnostics (``spec_probes.py``): ``--steps`` prints, per cell, where each engine's step
time goes (plan, controller, proposal, forward, verify, learn, the rest) and its steps grouped
by the way and number of drafts; ``--contention SECONDS`` replaces the cells by fresh engines
at batch 1 hit by a CPU spell that long, against speculation off (``--categories
code_editing --code-edit --proposers default --contention 3``: the code-editing prompts).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.code_edit_prompt import CODE_EDIT_PROMPTS
from benchmarks.common import Prompt, load_specbench, print_conditions, write_json
from benchmarks.lockstep import Timer, run, run_lockstep
from benchmarks.spec_probes import contention, part_timers, print_steps
from specbatch import LLMEngine
from specbatch.config import EngineConfig
from specbatch.spec_decode.proposers.drafting import NetworkProposer
from specbatch.spec_decode.tuning import SpeculationTuning

PROPOSER_OPTIONS = {
    "k": int,
    "min": int,
    "max": int,
    "conf": float,
    "adaptive": int,
    "tree": int,
    "dtree": int,
    "model": str,
    "nodes": int,
    "depth": int,
    "dkind": str,
    "ddtype": str,
    "store": int,
}


TUNING = {f.name: type(getattr(SpeculationTuning(), f.name)) for f in fields(SpeculationTuning)}


def tuning_value(key: str, text: str) -> Any:
    """A ``SpeculationTuning`` field's value from the command line (``0``/``1`` for a flag)."""
    kind = TUNING[key]
    return bool(int(text)) if kind is bool else kind(text)


def proposer_config(spec: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """``name[:key=value,...]`` (name default, ngram, draft, eagle or hybrid; keys k, min, max,
    conf, adaptive, tree: lookup trees, dtree: draft siblings, model: a draft model or head
    path, ddtype: the draft model's weights (``float32``, ``bfloat16``, ``q8_0``; default
    ``auto``), nodes
    and depth: a fixed draft tree of that many nodes, that deep, without the controller:
    ``eagle:nodes=16,depth=5``, dkind: ``siblings`` or ``dynamic`` trees) as a
    speculative_config, the command-line defaults filling what the spec leaves out;
    None for a plain ``default`` (``default:k=8``: auto with that k; ``default:tree=1,dtree=1``:
    auto with both trees; ``default:store=0``: auto without the store of other requests;
    ``eagle`` without model: the shipped head). Any field of
    ``SpeculationTuning`` is an option too (``default:hurdle=0,probe_every=0``)."""
    name, _, rest = spec.partition(":")
    if name not in ("default", "ngram", "draft", "eagle", "hybrid"):
        raise SystemExit(f"--proposers: unknown proposer {name!r} in {spec!r}")
    options: dict[str, Any] = {}
    tuning: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key in TUNING:
            tuning[key] = tuning_value(key, value)
        elif key in PROPOSER_OPTIONS:
            options[key] = PROPOSER_OPTIONS[key](value)
        else:
            raise SystemExit(f"--proposers: unknown option {key!r} in {spec!r}")
    config = _proposer_config(name, spec, options, args)
    if tuning:
        config = {**(config or {}), "tuning": tuning}
    return config


def _proposer_config(
    name: str, spec: str, options: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any] | None:
    if name == "default":  # auto, with only what the spec names changed
        if set(options) - {"k", "tree", "dtree", "model", "dkind", "ddtype", "store"}:
            raise SystemExit(
                "--proposers: default takes only k, tree, dtree, dkind, ddtype, store and "
                f"model, got {spec!r}"
            )
        auto: dict[str, Any] = {}
        if "model" in options:
            auto["model"] = options["model"]
        if "k" in options:
            auto["num_speculative_tokens"] = options["k"]
        if "tree" in options:
            auto["lookup_tree"] = bool(options["tree"])
        if "dtree" in options:
            auto["draft_tree"] = bool(options["dtree"])
        if "dkind" in options:
            auto["draft_tree_kind"] = options["dkind"]
        if "ddtype" in options:
            auto["draft_dtype"] = options["ddtype"]
        if "store" in options:
            auto["suffix_store_tokens"] = options["store"]
        return auto or None
    config: dict[str, Any] = {
        "method": "draft_model" if name == "draft" else name,
        "num_speculative_tokens": options.get("k", args.k),
        "adaptive_k": bool(options.get("adaptive", args.adaptive_k)),
    }
    if name not in ("draft", "eagle"):
        config["prompt_lookup_min"] = options.get("min", args.ngram_min)
        config["prompt_lookup_max"] = options.get("max", args.ngram_max)
        config["lookup_tree"] = bool(options.get("tree", 0))
    if name != "ngram":
        config["model"] = options.get("model", None if name == "eagle" else args.draft_model)
        config["draft_confidence_threshold"] = options.get("conf", args.draft_confidence)
        config["draft_tree"] = bool(options.get("dtree", 0))
        config["draft_tree_kind"] = options.get("dkind")
        config["draft_dtype"] = options.get("ddtype", "auto")
    if "nodes" in options or "depth" in options:
        if name == "ngram" or "k" in options or "adaptive" in options:
            raise SystemExit(
                f"--proposers: nodes/depth fix a draft tree, without k or adaptive: {spec!r}"
            )
        nodes = options.get("nodes", args.k)
        config.update(
            num_speculative_tokens=nodes,
            adaptive_k=False,
            draft_tree=True,
            draft_tree_depth=options.get("depth", nodes),
        )
    return config


def draft_forward_owner(engine: LLMEngine) -> tuple[Any, str]:
    """What to time for c: a drafting network's forward (catch-up or draft), or an n-gram
    proposer's lookup."""
    network = engine.proposer.network if engine.proposer is not None else None
    if isinstance(network, NetworkProposer):
        return network.net, "draft_logits"
    return engine.proposer, "propose"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dataset", required=True, help="Spec-Bench jsonl")
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--proposers",
        nargs="+",
        default=["ngram"],
        help="default, ngram, draft, eagle or hybrid, each optionally with options: "
        "'hybrid:min=2,conf=0.3' "
        "(k, min and max n-gram length, conf: draft confidence threshold, adaptive=1: "
        "adaptive_k, tree=1: lookup trees, dtree=1: draft siblings, model=PATH: a draft model "
        "or head, ddtype=float32|bfloat16|q8_0: the draft model's weights, or any "
        "SpeculationTuning field: 'default:hurdle=0'); 'default:tree=1,dtree=1' is auto with "
        "both",
    )
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--draft-confidence", type=float, default=0.0)
    parser.add_argument("--adaptive-k", action="store_true", help="adaptive_k for every proposer")
    parser.add_argument(
        "--prompts-per-category",
        type=int,
        default=2,
        help="distinct prompts per category (cycled to fill larger batches)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of every cell per engine (spread)"
    )
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="each engine runs a cell's repeat whole, one after another (default: in lockstep "
        "by tokens emitted)",
    )
    parser.add_argument(
        "--code-edit",
        action="store_true",
        help="add a 'code_editing' category (prompts that copy given code)",
    )
    parser.add_argument(
        "--steps", action="store_true", help="per cell, where each engine's step time goes"
    )
    parser.add_argument(
        "--contention",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="instead of the cells: fresh engines at batch 1 after a CPU spell this long "
        "(one busy process per core; --repeats: engines hit by one)",
    )
    parser.add_argument("--contention-runs", type=int, default=4, help="runs after the spell")
    parser.add_argument("--clean-first", type=int, default=0, help="runs before the spell")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--quantization",
        choices=["none", "gguf"],
        default="none",
        help="gguf: the target's GGUF weights multiplied as stored; none: dequantised to --dtype",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    return parser.parse_args()


def prompts_by_category(args: argparse.Namespace, tokenizer: Any) -> dict[str, list[list[int]]]:
    """Up to ``--prompts-per-category`` chat-formatted first turns per category (the plain
    text where the model has no chat template, as a base model's users send it)."""
    by_category: dict[str, list[list[int]]] = defaultdict(list)
    prompts = load_specbench(args.dataset, args.categories)
    if args.code_edit:
        prompts += [Prompt(text, "code_editing") for text in CODE_EDIT_PROMPTS]
    for prompt in prompts:
        if len(by_category[prompt.category]) < args.prompts_per_category:
            if tokenizer.chat_template is None:
                ids = tokenizer.encode(prompt.text)
            else:
                _, ids = tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
            by_category[prompt.category].append(ids[-args.max_prompt_len :])
    return dict(by_category)


def main() -> None:
    args = parse_args()
    if args.contention > 0:
        off = new_engine(args, "off")
        by_category = prompts_by_category(args, off.tokenizer)
        prompts = [ids for group in by_category.values() for ids in group]
        print_conditions(
            "a CPU spell at batch 1: fresh engines against speculation off (greedy)",
            **conditions(args, by_category, off),
            spell=f"{os.cpu_count()} busy processes for {args.contention} s at the start of "
            f"the first measured run, after {args.clean_first} undisturbed runs",
            runs=args.contention_runs,
        )
        del off
        contention(lambda name: new_engine(args, name), args.proposers, prompts, args)
        return
    engines = {name: new_engine(args, name) for name in ["off", *args.proposers]}
    off = engines["off"]
    parts = {name: part_timers(engine) for name, engine in engines.items()}
    draft_timer = {
        name: Timer(*draft_forward_owner(engine))
        for name, engine in engines.items()
        if engine.proposer is not None
    }
    timers = [*draft_timer.values(), *(t for p in parts.values() for t in p.values())]
    by_category = prompts_by_category(args, off.tokenizer)
    print_conditions(
        "speculative decoding vs off (greedy, EOS or max tokens)",
        **conditions(args, by_category, off),
    )
    for engine in engines.values():  # warm-up
        run(engine, [next(iter(by_category.values()))[0]], 8, 1)

    rows = []
    for category, token_ids in sorted(by_category.items()):
        for batch in args.batch_sizes:
            cycled = token_ids * (batch // len(token_ids) + 1)
            batch_prompts = cycled[: max(batch, len(token_ids))]
            results: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for _ in range(args.repeats):
                for timer in timers:
                    timer.reset()
                for engine in engines.values():  # held out: no cell sees another's outputs
                    forget_other_requests(engine)
                if args.sequential:
                    repeat = {
                        name: run(engine, batch_prompts, args.max_tokens, batch)
                        for name, engine in engines.items()
                    }
                else:
                    repeat = run_lockstep(engines, batch_prompts, args.max_tokens, batch)
                for name, result in repeat.items():
                    result["target_step_s"] = parts[name]["forward"].mean
                    if name in draft_timer:  # per draft forward (n-gram: per lookup)
                        result["draft_step_s"] = draft_timer[name].mean
                    results[name].append(result)
            rows += cell_rows(category, batch, results)
            if args.steps:
                for name, repeats in results.items():
                    print_steps(name, repeats[-1]["steps"], parts[name])
    print_summary(rows, list(engines), args.batch_sizes, sorted(by_category))
    write_json(args.json, {"conditions": vars(args), "rows": rows})
    if args.plot:
        plot(rows, args)


def forget_other_requests(engine: LLMEngine) -> None:
    """Empty the engine's store of other requests' tokens, if it keeps one: a cell's prompts
    recur (cycled to the batch, in every repeat, at every batch size), and drafts copied from
    their own earlier outputs would measure the repeats, not the text."""
    lookup = engine.proposer.lookup if engine.proposer is not None else None
    if lookup is not None and lookup.store is not None:
        lookup.store.clear()


def new_engine(args: argparse.Namespace, name: str) -> LLMEngine:
    """An engine for ``off`` or a ``--proposers`` spec."""
    spec = {"method": "off"} if name == "off" else proposer_config(name, args)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=None if args.quantization == "none" else args.quantization,
        max_model_len=2048,
        max_num_seqs=max(args.batch_sizes),
        enable_prefix_caching=False,
        speculative_config=spec,
    )
    return LLMEngine(config)


def conditions(
    args: argparse.Namespace, by_category: dict[str, Any], off: LLMEngine
) -> dict[str, Any]:
    """What the benchmark runs under, for ``print_conditions``."""
    return {
        "model": off.model_path.name,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "device": off.device,
        "k": args.k,
        "proposers": args.proposers,
        "draft_model": args.draft_model or "-",
        "ngram": f"{args.ngram_min}..{args.ngram_max}",
        "draft_confidence": args.draft_confidence,
        "batch_sizes": [1] if args.contention else args.batch_sizes,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "timing": "sequential runs"
        if args.sequential or args.contention
        else "lockstep by tokens emitted",
        "dataset": args.dataset,
        "categories": sorted(by_category),
        "prompts_per_category": args.prompts_per_category,
    }


def cell_rows(
    category: str, batch: int, results: dict[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """One row per engine of a cell (its repeats' median against off's), each printed."""
    base = results["off"]
    rows = []
    for name, repeats in results.items():
        ratios = sorted(r["tok_s"] / b["tok_s"] for r, b in zip(repeats, base, strict=True))
        r = repeats[-1]
        row = {
            "category": category,
            "batch": batch,
            "proposer": name,
            "tok_s": statistics.median(x["tok_s"] for x in repeats),
            "speedup": statistics.median(ratios),
            "speedup_min": ratios[0],
            "speedup_max": ratios[-1],
            "mean_accepted_length": r["mean_accepted_length"],
            "acceptance_rate": r["acceptance_rate"],
            "c": r.get("draft_step_s", 0.0) / base[-1]["target_step_s"],
            "drafting_share": r["drafting_share"],
            "drafts_per_step": r["drafts_per_step"],
            "row_cost": r["row_cost"],
            "tokens": r["tokens"],
            "identical_output": all(x["outputs"] == base[0]["outputs"] for x in repeats),
            "acceptance_by_depth": r["acceptance_by_depth"],
        }
        rows.append(row)
        print(
            f"{category:>18} b={batch:<3} {name:>22}: {row['tok_s']:7.1f} tok/s "
            f"x{row['speedup']:.2f} ({ratios[0]:.2f}..{ratios[-1]:.2f}) "
            f"len {row['mean_accepted_length']:.2f} c {row['c']:.3f} "
            f"drafting {row['drafting_share']:.0%} {row['drafts_per_step']:.1f}/step "
            f"row {row['row_cost']:.3f} by depth "
            + "/".join(f"{a:.2f}" for a in row["acceptance_by_depth"][:6])
            + ("" if row["identical_output"] else " OUTPUT DIFFERS"),
            flush=True,
        )
    return rows


def print_summary(
    rows: list[dict[str, Any]], names: list[str], batch_sizes: list[int], categories: list[str]
) -> None:
    """The table, the cells below x0.97, the default against the best fixed choice, and
    geometric means per batch size."""
    print()
    print(
        f"{'category':>18} {'batch':>5} {'proposer':>22} {'tok/s':>8} {'speedup':>8} "
        f"{'spread':>11} {'acc.len':>7} {'acc.rate':>8} {'c':>6} {'drafting':>8}"
    )
    for r in rows:
        print(
            f"{r['category']:>18} {r['batch']:>5} {r['proposer']:>22} {r['tok_s']:>8.1f} "
            f"{r['speedup']:>7.2f}x {r['speedup_min']:>5.2f}..{r['speedup_max']:<4.2f} "
            f"{r['mean_accepted_length']:>7.2f} "
            f"{100 * r['acceptance_rate']:>7.1f}% {r['c']:>6.3f} {r['drafting_share']:>8.0%}"
        )
    print()
    for name in names[1:]:
        low = [r for r in rows if r["proposer"] == name and r["speedup"] < 0.97]
        print(
            f"{name}: {len(low)} of {sum(r['proposer'] == name for r in rows)} cells below "
            "x0.97" + "".join(f"; {r['category']} b={r['batch']} x{r['speedup']:.2f}" for r in low)
        )
    fixed = [name for name in names if name != "off" and not name.startswith("default")]
    if "default" in names and fixed:  # the default against the best fixed choice in hindsight
        for batch in batch_sizes:
            for category in categories:
                cell = {
                    r["proposer"]: r["speedup"]
                    for r in rows
                    if r["batch"] == batch and r["category"] == category
                }
                best = max(fixed, key=lambda name: cell[name])
                print(
                    f"b={batch:<3} {category:>18}: default x{cell['default']:.2f}, best fixed "
                    f"{best} x{cell[best]:.2f}: {cell['default'] / cell[best]:.2f} of it"
                )
    print()
    for batch in batch_sizes:
        for name in names:
            speedups = [r["speedup"] for r in rows if r["batch"] == batch and r["proposer"] == name]
            low, high = min(speedups), max(speedups)
            geomean = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
            print(
                f"b={batch:<3} {name:>22}: geometric mean x{geomean:.2f} over "
                f"{len(speedups)} categories (x{low:.2f} .. x{high:.2f})"
            )


def plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    proposers = [p for p in dict.fromkeys(r["proposer"] for r in rows) if p != "off"]
    fig, axes = plt.subplots(1, len(proposers), figsize=(6 * len(proposers), 4.5), squeeze=False)
    for ax, proposer in zip(axes[0], proposers, strict=True):
        for category in sorted({r["category"] for r in rows}):
            points = [
                (r["batch"], r["speedup"])
                for r in rows
                if r["proposer"] == proposer and r["category"] == category
            ]
            ax.plot(*zip(*points, strict=True), marker="o", label=category)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup over speculation off")
        ax.set_title(f"{proposer}, k={args.k}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
