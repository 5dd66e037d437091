"""Offline throughput: a batch of prompts through specbatch, optionally against HF ``generate``.

    python benchmarks/throughput.py --dataset ../shared/data/specbench_dev.jsonl \
        --batch-sizes 1 16 64 --output-len 128 --compare-hf

Every request generates exactly ``--output-len`` tokens (EOS ignored) so both systems do the same
work, with speculation off (``--speculative auto``: the default speculation). Reports output
tok/s, requests/s, time per output token, the per-step Python overhead (step time minus model
time), KV-cache waste (allocated slots not holding a valid token, averaged over steps) and
resident memory beyond weights and KV cache (the KV cache's resident pages read from
``/proc/self/smaps``). Ratios are against HF run in this process. ``--profile N``: one more run
per batch size under cProfile, printing the N functions with the most time of their own (the
linears are oneDNN's ``_linear_pointwise`` or ``gguf_linear``'s kernel, attention the
backend's call).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import (
    hf_generate_tokens,
    hf_model,
    kv_ranges,
    load_specbench,
    median_and_spread,
    print_conditions,
    resident_bytes,
    rss_bytes,
    write_json,
)
from specbatch import LLMEngine, SamplingParams
from specbatch.cache.kv_tensors import kv_bytes_per_block
from specbatch.config import EngineConfig


def prompt_ids(engine: LLMEngine, args: argparse.Namespace, count: int) -> list[list[int]]:
    tokenizer = engine.tokenizer
    if args.dataset:
        texts = [p.text for p in load_specbench(args.dataset)]
    else:
        texts = [f"Write a short story about the number {i}." for i in range(count)]
    texts = (texts * (count // max(len(texts), 1) + 1))[:count]
    ids = []
    for text in texts:
        _, chat_ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        ids.append(chat_ids[: args.max_prompt_len])
    return ids


def run_specbatch(
    engine: LLMEngine, prompts: list[list[int]], output_len: int, concurrency: int
) -> dict[str, Any]:
    """Generate for every prompt, keeping at most ``concurrency`` requests in flight."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    model_time = 0.0
    forward = engine.runner.forward

    def timed_forward(*a: Any, **k: Any) -> Any:
        nonlocal model_time
        start = time.perf_counter()
        out = forward(*a, **k)
        model_time += time.perf_counter() - start
        return out

    engine.runner.forward = timed_forward  # type: ignore[method-assign]
    pending = list(enumerate(prompts))
    waste, steps, tpots, peak_rss = [], 0, [], 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_unfinished_requests() < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                m = out.metrics
                if m.first_token_time and m.finished_time and output_len > 1:
                    tpots.append((m.finished_time - m.first_token_time) / (output_len - 1))
        steps += 1
        running = engine.scheduler.running
        allocated = sum(len(s.block_table) for s in running) * engine.config.block_size
        if allocated:
            valid = sum(s.num_computed_tokens for s in running)
            waste.append(1 - valid / allocated)
        peak_rss = max(peak_rss, rss_bytes())
    elapsed = time.perf_counter() - start
    engine.runner.forward = forward  # type: ignore[method-assign]
    return {
        "elapsed": elapsed,
        "tokens": output_len * len(prompts),
        "steps": steps,
        "overhead_ms_per_step": 1000 * (elapsed - model_time) / max(steps, 1),
        "kv_waste": statistics.mean(waste) if waste else 0.0,
        "tpot_ms": 1000 * statistics.median(tpots) if tpots else float("nan"),
        "peak_rss": peak_rss,
    }


def profile(
    engine: LLMEngine, prompts: list[list[int]], output_len: int, batch: int, top: int
) -> None:
    """One run under cProfile: the ``top`` functions by their own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    result = run_specbatch(engine, prompts, output_len, batch)
    profiler.disable()
    print(f"-- cProfile, batch {batch}: {result['steps']} steps in {result['elapsed']:.2f} s")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dataset", default=None, help="Spec-Bench jsonl (first turns)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="prompts per batch size (default: the batch size, at least 2)",
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--quantization",
        choices=["none", "gguf"],
        default="none",
        help="gguf: the GGUF weights multiplied as stored; none: dequantised to --dtype",
    )
    parser.add_argument("--speculative", choices=["off", "auto"], default="off")
    parser.add_argument("--compare-hf", action="store_true")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's top N")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    baseline_rss = rss_bytes()  # interpreter, torch and the other libraries
    config: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": None if args.quantization == "none" else args.quantization,
        "max_model_len": 1024,
        "max_num_seqs": max(args.batch_sizes),
        "max_num_batched_tokens": 2048,
        "speculative_config": {"method": args.speculative},  # auto: the default speculation
    }
    engine = LLMEngine(EngineConfig(**config))
    weights = engine.model.weight_bytes()
    kv_reserved = engine.num_kv_blocks * kv_bytes_per_block(
        engine.model.config, engine.config.block_size, engine.dtype
    )
    print_conditions(
        "throughput (offline batch, greedy, EOS ignored)",
        model=engine.model_path.name,
        dtype=args.dtype,
        quantization=args.quantization,
        speculative=args.speculative,
        device=engine.device,
        batch_sizes=args.batch_sizes,
        output_len=args.output_len,
        prompts=args.dataset or "synthetic",
        repeats=args.repeats,
        kv_blocks=f"{engine.num_kv_blocks} x {engine.config.block_size}",
        memory=f"weights {weights / 2**20:.0f} MiB, KV cache {kv_reserved / 2**20:.0f} MiB "
        "reserved (committed as used), "
        f"libraries at start {baseline_rss / 2**20:.0f} MiB",
    )
    # Phases: specbatch, then HF, then specbatch again. Bracketing HF between two specbatch
    # passes cancels slow drift of the shared machine, and RSS is read before HF is loaded.
    sizes = args.batch_sizes
    prompts = {b: prompt_ids(engine, args, args.num_prompts or max(b, 2)) for b in sizes}
    ours: dict[int, list[float]] = {b: [] for b in sizes}
    last: dict[int, dict[str, Any]] = {}

    def specbatch_pass(repeats: int) -> None:
        for b in sizes:
            run_specbatch(engine, prompts[b][:2], 4, b)  # warm-up
            for _ in range(repeats):
                last[b] = run_specbatch(engine, prompts[b], args.output_len, b)
                ours[b].append(last[b]["tokens"] / last[b]["elapsed"])
            print(f"specbatch batch {b}: {[round(r, 1) for r in ours[b]]} tok/s", flush=True)

    first = max(1, (args.repeats + 1) // 2)
    specbatch_pass(first)
    rss_before_hf = {b: last[b]["peak_rss"] for b in sizes}
    # KV pages stay resident once touched, so what is resident now is the peak so far
    kv_bytes = resident_bytes(kv_ranges(engine))
    hf_rates: dict[int, list[float]] = {b: [] for b in sizes}
    if args.compare_hf:
        hf = hf_model(engine.model_path, torch.float32)
        pad = engine.tokenizer.pad_token_id or 0
        for b in sizes:
            batches = [prompts[b][i : i + b] for i in range(0, len(prompts[b]), b)]
            for _ in range(args.repeats):
                start = time.perf_counter()
                tokens = hf_generate_tokens(hf, batches, args.output_len, pad)
                hf_rates[b].append(tokens / (time.perf_counter() - start))
            print(f"HF batch {b}: {[round(r, 1) for r in hf_rates[b]]} tok/s", flush=True)
        del hf
        specbatch_pass(args.repeats - first)

    if args.profile:
        for b in sizes:
            profile(engine, prompts[b], args.output_len, b, args.profile)

    rows, results = [], {}
    for b in sizes:
        med, spread = median_and_spread(ours[b])
        result = last[b]
        row = {
            "batch": b,
            "prompts": len(prompts[b]),
            "tok_s": med,
            "tok_s_spread": spread,
            "req_s": med / args.output_len,
            "tpot_ms": result["tpot_ms"],
            "overhead_ms_per_step": result["overhead_ms_per_step"],
            "kv_waste": result["kv_waste"],
            "rss_beyond_weights_kv_mb": (rss_before_hf[b] - weights - kv_bytes) / 2**20,
            "rss_beyond_weights_kv_libs_mb": (rss_before_hf[b] - weights - kv_bytes - baseline_rss)
            / 2**20,
        }
        if hf_rates[b]:
            hf_med, hf_spread = median_and_spread(hf_rates[b])
            row.update(hf_tok_s=hf_med, hf_spread=hf_spread, ratio=med / hf_med)
        rows.append(row)
        results[str(b)] = row

    print()
    print(
        f"{'batch':>5} {'tok/s':>9} {'±':>6} {'req/s':>7} {'TPOT ms':>8} {'ovh ms':>7} "
        f"{'waste':>6} {'RSS+':>6} {'work':>6} {'HF tok/s':>9} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['tok_s']:>9.1f} {r['tok_s_spread']:>6.1f} {r['req_s']:>7.2f} "
            f"{r['tpot_ms']:>8.1f} {r['overhead_ms_per_step']:>7.1f} "
            f"{100 * r['kv_waste']:>5.1f}% {r['rss_beyond_weights_kv_mb']:>6.0f} "
            f"{r['rss_beyond_weights_kv_libs_mb']:>6.0f} "
            f"{r.get('hf_tok_s', float('nan')):>9.1f} {r.get('ratio', float('nan')):>6.2f}"
        )
    print(
        "RSS+: resident MiB beyond weights and KV cache; work: the same minus the libraries' "
        "resident size at start; ovh: step time minus model time"
    )
    write_json(args.json, {"conditions": vars(args), "results": results})


if __name__ == "__main__":
    main()
