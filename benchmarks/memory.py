"""Memory of the engine with N sequences running: the process beyond its weights and KV cache.

The KV cache is committed as blocks are first used (anonymous maps), so its share is read
exactly from ``/proc/self/smaps`` (the resident pages of its mappings); weights are the bytes the
model holds (plain and packed). What remains of RSS (and of its anonymous part, without the
shared-library pages) is interpreter, torch, activations and bookkeeping: the number this
benchmark is about. It prints the peak over the steps of a run, sampled every step.

    python benchmarks/memory.py --num-seqs 64 --output-len 128 [--dataset PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_specbench, print_conditions, write_json
from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig

MIB = 1 << 20


def status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def resident_bytes(ranges: list[tuple[int, int]]) -> int:
    """Resident bytes of the mappings that overlap the given address ranges."""
    total, current = 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                current = (start, end)
            elif (
                head == "Rss:"
                and current is not None
                and any(s < current[1] and current[0] < e for s, e in ranges)
            ):
                total += int(line.split()[1]) * 1024
    return total


def kv_ranges(engine: LLMEngine) -> list[tuple[int, int]]:
    ranges = []
    models = [engine.model] + ([engine.draft_model] if engine.draft_model is not None else [])
    for model in models:
        for layer in model.model.layers:
            for tensor in layer.self_attn.kv_cache or ():
                start = tensor.data_ptr()
                ranges.append((start, start + tensor.numel() * tensor.element_size()))
    return ranges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dataset", default=None)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--speculative", default="off", choices=["off", "ngram", "hybrid"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    before_load = status_kib("VmRSS") * 1024
    speculative = None if args.speculative == "off" else {"method": args.speculative}
    engine = LLMEngine(
        EngineConfig(model=args.model, max_num_seqs=args.num_seqs, speculative_config=speculative)
    )
    tokenizer = engine.tokenizer
    if args.dataset:
        texts = [p.text for p in load_specbench(args.dataset)]
    else:
        texts = [f"Write a short story about the number {i}." for i in range(args.num_seqs)]
    texts = (texts * (args.num_seqs // len(texts) + 1))[: args.num_seqs]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}])[1] for t in texts]
    weights = engine.model.weight_bytes()
    if engine.draft_model is not None:
        weights += engine.draft_model.weight_bytes()
    print_conditions(
        "process memory beyond weights and KV cache",
        model=engine.model_path.name,
        dtype=engine.dtype,
        sequences=args.num_seqs,
        prompt_tokens=f"{min(map(len, prompts))}-{max(map(len, prompts))}",
        output_len=args.output_len,
        speculative=args.speculative,
        kv_blocks=engine.num_kv_blocks,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=ids, params=params)
    ranges = kv_ranges(engine)
    peak: dict[str, float] = {"rss": 0, "anon": 0, "kv": 0, "beyond": 0, "beyond_anon": 0}
    running_max = 0
    while engine.has_unfinished_requests():
        engine.step()
        running_max = max(running_max, engine.stats.num_running)
        rss, anon = status_kib("VmRSS") * 1024, status_kib("RssAnon") * 1024
        kv = resident_bytes(ranges)
        for key, value in (
            ("rss", rss),
            ("anon", anon),
            ("kv", kv),
            ("beyond", rss - weights - kv),
            ("beyond_anon", anon - weights - kv),
        ):
            peak[key] = max(peak[key], value)
    rows = [
        ("RSS before loading (interpreter, torch)", before_load),
        ("peak RSS", peak["rss"]),
        ("weights (plain + packed)", weights),
        ("KV cache resident (peak)", peak["kv"]),
        ("peak RSS beyond weights + KV", peak["beyond"]),
        ("peak anonymous RSS beyond weights + KV", peak["beyond_anon"]),
    ]
    print(f"sequences running at once: {running_max}")
    print(f"{'':44s} {'MiB':>8s}")
    for name, value in rows:
        print(f"{name:44s} {value / MIB:8.1f}")
    if args.json:
        write_json(args.json, {name: value / MIB for name, value in rows})


if __name__ == "__main__":
    main()
