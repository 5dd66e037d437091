"""The GGUF files users bring, side by side: specbatch's weight modes on each file against
llama.cpp on the same file, in one run.

python benchmarks/model_files.py --dataset ../shared/data/specbench_dev.jsonl --models A.gguf
B.gguf [--llama-cpp-python PEERS/lc/bin/python] [--batch-sizes 1 16 64] [--output-len 64]
[--long-prompts 2] [--json out.json]

Every system gets the same token ids per file (the dataset's first turns as plain text, no chat
template: base models have none, tokenized by specbatch's tokenizer of that file), generates
exactly ``--output-len`` tokens (EOS ignored), greedy, 2 threads. Each (file, mode) runs in its
own process, so its peak resident memory (VmHWM) is its own, reported beside the file's size.
Modes: the exact mode (``quantization="gguf"``: the file's blocks as stored) with speculation
off (``{"method": "off"}``) and with the default (``{"method": "auto"}``: prompt lookup under
the goodput controller for a model without a shipped draft), float32 and bfloat16 with
speculation off. Rows per mode: short prompts at each batch size (batch 1: eight prompts one
after the other), the long prompts at batch 1 (the dataset's 450-800-token prompts), and for
the exact mode the batch-1 linear floor (every linear layer and the LM head on one row, timed
alone: what a decode step would take with nothing else). Then each mode's greedy tokens on the
short prompts compared across the files (the first file's are the reference). With
``--repeats N`` each file's modes run N times, interleaved (in order, then reversed, ...), each
cell is the median of its runs, and each mode's tok/s over ``exact off``'s is printed per row as
the median of the per-repeat ratios with their range: the host's drift between processes
(2-10% minutes apart) lands on every mode alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_specbench, median_seconds, print_conditions, write_json

MODES: dict[str, dict[str, Any]] = {
    "exact off": {"quantization": "gguf", "speculative_config": {"method": "off"}},
    "exact auto": {"quantization": "gguf", "speculative_config": {"method": "auto"}},
    "float32 off": {"dtype": "float32", "speculative_config": {"method": "off"}},
    "bfloat16 off": {"dtype": "bfloat16", "speculative_config": {"method": "off"}},
}

LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
llm = Llama(model_path=job["model"], n_threads=2, n_ctx=2048, verbose=False)
results = {}
for name, prompts in job["sets"].items():
    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        llm.reset()
        for count, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1)):
            if count + 1 >= job["output_len"]:
                break
        tokens += count + 1
    results[name] = tokens / (time.perf_counter() - start)
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        results["peak_mib"] = int(line.split()[1]) / 1024
print(json.dumps(results))
"""


def prompt_sets(model: str, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """The short and long prompts as this file's token ids."""
    from specbatch.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    prompts = load_specbench(args.dataset)
    ids = [tokenizer.encode(p.text) for p in prompts]
    short = [p for p in ids if len(p) < 200][: max(8, max(args.batch_sizes))]
    long = [p for p in ids if 450 <= len(p) <= 800][: args.long_prompts]
    return {"short": short, "long": long}


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One (file, mode) in this process: tok/s per row, greedy tokens, peak memory."""
    from specbatch import LLMEngine, SamplingParams
    from specbatch.config import EngineConfig

    sizes, output_len = job["batch_sizes"], job["output_len"]
    config = EngineConfig(
        model=job["model"], max_num_seqs=max(sizes), max_model_len=2048, **job["settings"]
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    out: dict[str, Any] = {"weight_mode": str(engine.weight_mode)}
    sets = job["sets"]
    runs = [(f"b{b}", sets["short"][: 8 if b == 1 else b], b == 1) for b in sizes]
    runs.append(("long", sets["long"], True))
    for key, prompts, one_by_one in runs:
        if not prompts:
            continue
        generate(engine, prompts[:2], params, False)  # warm-up
        start = time.perf_counter()
        tokens = generate(engine, prompts, params, one_by_one)
        out[key] = tokens / (time.perf_counter() - start)
    if job["floor"]:
        out["floor-b1"] = linear_floor(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len)
    out["greedy"] = [
        list(o.outputs[0].token_ids) for o in run_all(engine, sets["short"][:8], greedy)
    ]
    out["peak_mib"] = peak_mib()
    return out


def generate(engine: Any, prompts: list[list[int]], params: Any, one_by_one: bool) -> int:
    groups = [[p] for p in prompts] if one_by_one else [prompts]
    return sum(len(o.outputs[0].token_ids) for g in groups for o in run_all(engine, g, params))


def run_all(engine: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt_token_ids=ids, params=params)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return [done[k] for k in sorted(done, key=lambda k: int(k.rsplit("-", 1)[1]))]


def linear_floor(engine: Any, repeats: int = 20) -> float:
    """Tokens per second if a batch-1 decode cost only its linear layers and the LM head."""
    import torch

    from specbatch.kernels.linear import Linear

    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    inputs = {id(m): torch.randn(1, m.in_features) for m in linears}
    hidden = torch.randn(1, model.config.hidden_size)

    def step() -> None:
        with torch.no_grad():
            for module in linears:
                module(inputs[id(module)])
            model.compute_logits(hidden)

    return 1.0 / median_seconds(step, repeats)


def peak_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def in_subprocess(command: list[str], job: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "job.json"
        path.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        result = subprocess.run([*command, str(path)], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        print(f"failed: {' '.join(command)}\n{result.stderr[-3000:]}", file=sys.stderr)
        return {}
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--bf16-batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--long-prompts", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode, interleaved")
    parser.add_argument("--llama-cpp-python")
    parser.add_argument("--json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(Path(args.worker).read_text()))))
        return
    print_conditions(
        "GGUF files: specbatch's modes against llama.cpp on the same file",
        models=", ".join(args.models),
        batch_sizes=args.batch_sizes,
        output_len=args.output_len,
        repeats=args.repeats,
        greedy="yes, EOS ignored (greedy agreement rows keep EOS)",
        threads=2,
    )
    table: dict[str, dict[str, Any]] = {}
    for model in args.models:
        name = Path(model).name
        sets = prompt_sets(model, args)
        size_mib = Path(model).stat().st_size / 2**20
        print(f"{name}: {size_mib:.0f} MiB, prompts {len(sets['short'])} short, "
              f"{len(sets['long'])} long", flush=True)  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
        for repeat in range(args.repeats):
            for mode in args.modes if repeat % 2 == 0 else args.modes[::-1]:
                sizes = args.batch_sizes
                if mode.startswith("bfloat16") and args.bf16_batch_sizes:
                    sizes = args.bf16_batch_sizes
                job = {
                    "model": model, "settings": MODES[mode], "sets": sets, "batch_sizes": sizes,
                    "output_len": args.output_len, "floor": mode == "exact off",
                }  # fmt: skip
                command = [sys.executable, "-m", "benchmarks.model_files", "--dataset",
                           args.dataset, "--models", model, "--worker"]  # fmt: skip
                runs[mode].append(in_subprocess(command, job))
                print(f"  {mode} #{repeat}: {_row(runs[mode][-1])}", flush=True)
        for mode, results in runs.items():
            table[f"{name} | {mode}"] = _median(results) | {"file_mib": size_mib}
            if args.repeats > 1:
                print(f"  {mode}: {_row(table[f'{name} | {mode}'])} (medians)", flush=True)
        _print_ratios(runs)
        if args.llama_cpp_python:
            job = {"model": model, "sets": {"b1": sets["short"][:8], "long": sets["long"]},
                   "output_len": args.output_len}  # fmt: skip
            result = in_subprocess([args.llama_cpp_python, "-c", LLAMA_CPP], job)
            table[f"{name} | llama.cpp"] = result | {"file_mib": size_mib}
            print(f"  llama.cpp: {_row(result)}", flush=True)
    report(table, args)
    write_json(args.json, {"args": vars(args), "table": table})


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's median over the runs that have it (other values: the first run's)."""
    out: dict[str, Any] = {}
    for key, value in (results[0] if results else {}).items():
        values = [r[key] for r in results if key in r]
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        out[key] = statistics.median(values) if numeric else value
    return out


def _print_ratios(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Each mode's tok/s over ``exact off``'s in the same repeat: median (range) per row."""
    base = runs.get("exact off")
    if not base:
        return
    for mode, results in runs.items():
        if mode == "exact off":
            continue
        cells = []
        for key in [k for k in base[0] if k.startswith("b") or k == "long"]:
            ratios = sorted(
                r[key] / b[key] for r, b in zip(results, base, strict=True) if key in r and key in b
            )
            if ratios:
                median = statistics.median(ratios)
                cells.append(f"{key} {median:.3f}x ({ratios[0]:.3f}..{ratios[-1]:.3f})")
        print(f"  {mode} / exact off: {', '.join(cells)}", flush=True)


def _row(result: dict[str, Any]) -> str:
    keys = [k for k in result if k not in ("greedy", "weight_mode", "file_mib")]
    return ", ".join(f"{k} {result[k]:.1f}" for k in keys)


def report(table: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    columns = [f"b{b}" for b in args.batch_sizes] + ["long", "floor-b1", "peak_mib", "file_mib"]
    print("\n| system | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for label, result in table.items():
        cells = [f"{result[c]:.1f}" if c in result else "-" for c in columns]
        print(f"| {label} | " + " | ".join(cells) + " |")
    lc = {k.split(" | ")[0]: v for k, v in table.items() if k.endswith("llama.cpp")}
    for label, result in table.items():
        base = lc.get(label.split(" | ")[0])
        if base and "b1" in result and "llama.cpp" not in label and "b1" in base:
            ratios = [f"b1 {result['b1'] / base['b1']:.2f}x"]
            if "long" in result and "long" in base:
                ratios.append(f"long {result['long'] / base['long']:.2f}x")
            print(f"{label} against llama.cpp: {', '.join(ratios)}")
        if "floor-b1" in result and "b1" in result:
            print(f"{label}: batch 1 at {result['b1'] / result['floor-b1']:.2f}x its linear floor")
    for mode in args.modes:
        rows = [table.get(f"{Path(m).name} | {mode}", {}).get("greedy") for m in args.models]
        if rows[0] is None:
            continue
        for model, row in zip(args.models[1:], rows[1:], strict=True):
            if row is not None:
                same = sum(a == b for a, b in zip(rows[0], row, strict=False))
                print(f"{mode}: {Path(model).name} greedy equal to "
                      f"{Path(args.models[0]).name} on {same}/{len(row)} prompts")  # fmt: skip


if __name__ == "__main__":
    main()
