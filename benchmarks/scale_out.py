"""Scaling out on one host: the tensor-parallel collectives alone and the step, data-parallel
replicas under a request-rate sweep, and a Ray batch job against one engine.

    python benchmarks/scale_out.py [--parts collectives step dp ray] [--ranks 2 3] [--tp 2]

``collectives``: ``--ranks`` processes joined by gloo (a file store) and one shared-memory
segment (``specbatch/models/shm_collectives.py``); each times, on the same tensors, gloo's
``all_reduce`` and the segment's (the hidden rows of 1, 16 and 256 tokens of SmolLM2, float32)
and both all-gathers of a logits row's vocabulary slice, median of ``--repeats`` after a
warm-up, rank 0's clock. Ratios are gloo's time over the segment's, same processes, same run.

``step``: ``--tp`` ranks with their collectives through shared memory, the same through gloo
alone, and one process, speculation off (``{"method": "off"}``), greedy, EOS ignored,
``--output-len`` tokens for each of ``--batch-sizes`` prompts at once; mean step time and the
ratios to one process in the same run. The model: SmolLM2-135M (float32: ranks are not
quantized) when ``--tp`` divides its 9 heads, else a random model of its shape with 8 heads
and 2 KV heads (head size 72; the step's cost, not its text). On a 2-core host the ranks share
the cores (each gets ``cores / ranks`` threads), so this measures what the collectives and the
per-rank overhead cost, not a speed-up.

``dp``: one engine (all cores) against ``DataParallelEngine`` with 2 replicas (one core each),
the default model and mode (``quantization="auto"``), the default speculation, each under a
Poisson request-rate sweep (``--rates`` requests/s, ``--dp-requests`` requests of
``--dp-output-len`` tokens): completion tok/s over the run, TTFT p50/p99, the ratio of the two
at each rate. Both are driven through the same asyncio interface the server uses.

``ray``: ``--ray-requests`` completion lines (``--ray-output-len`` tokens, greedy) through
``run-batch`` on one engine (all cores) and through ``run-batch --ray`` with 2 replicas of one
core each on a local Ray cluster started for it; wall time including everything each command
does (Ray's start, both replicas' loads), tok/s and the ratio; the outputs' text compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import print_conditions
from benchmarks.lockstep import run
from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.models import shm_collectives as shm

HIDDEN, VOCAB = 576, 49152


def _rank_main(rank: int, world: int, store: str, name: str, repeats: int, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if rank == 0:
        group = shm.SharedMemoryGroup(name, 0, world, 4 << 20, create=True)
    dist.barrier()
    if rank:
        group = shm.SharedMemoryGroup(name, rank, world, 4 << 20, create=False)
    dist.barrier()
    group.unlink()
    cases: list[tuple[str, Any, Any]] = []
    for tokens in (1, 16, 256):
        x = torch.randn(tokens, HIDDEN)
        cases.append(
            (
                f"all_reduce {tokens}x{HIDDEN}",
                lambda x=x: dist.all_reduce(x),
                lambda x=x: group.all_reduce(x),
            )
        )
    row = torch.randn(1, VOCAB // world)
    parts = [torch.empty_like(row) for _ in range(world)]
    cases.append(
        (
            f"all_gather 1x{VOCAB // world}",
            lambda: dist.all_gather(parts, row),
            lambda: group.all_gather(row),
        )
    )
    times: dict[str, tuple[float, float]] = {}
    for label, gloo, ours in cases:
        medians = []
        for fn in (gloo, ours):
            for _ in range(5):
                fn()
            samples = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            medians.append(statistics.median(samples))
        times[label] = (medians[0], medians[1])
    if rank == 0:
        queue.put(times)
    dist.barrier()
    group.close()
    dist.destroy_process_group()


def collectives(world: int, repeats: int) -> None:
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        store = str(Path(scratch) / "store")
        name = shm.new_name()
        processes = [
            context.Process(target=_rank_main, args=(r, world, store, name, repeats, queue))
            for r in range(world)
        ]
        for process in processes:
            process.start()
        times = queue.get(timeout=600)
        for process in processes:
            process.join(timeout=60)
    for label, (gloo, ours) in times.items():
        print(
            f"  {world} ranks  {label:24s} gloo {gloo * 1e6:9.1f} us  shared memory "
            f"{ours * 1e6:8.1f} us  ({gloo / ours:5.1f}x)",
            flush=True,
        )


def step_model(tp: int, scratch: Path) -> str | None:
    """SmolLM2 itself (None: the default) when ``tp`` splits its heads, else its shape with 8
    heads and 2 KV heads, random."""
    if 9 % tp == 0:
        return None
    from tests.helpers import write_tiny_model

    return str(
        write_tiny_model(
            scratch,
            hidden_size=HIDDEN,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=1536,
            num_hidden_layers=30,
            vocab_size=VOCAB,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
        )
    )


def step(tp: int, batch_sizes: list[int], output_len: int) -> None:
    from specbatch.parallel import workers

    prompts = [[1, 504, 3360, 282, 1638, 30, 28, 100 + i] for i in range(max(batch_sizes))]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    steps: dict[tuple[str, int], float] = {}
    texts: dict[tuple[str, int], list[list[int]]] = {}
    available = shm.available
    with tempfile.TemporaryDirectory() as scratch:
        model = step_model(tp, Path(scratch))
        print(f"  model: {model or 'SmolLM2-135M-Instruct'}", flush=True)
        for label, ranks, collectives in (
            ("one process", 1, "-"),
            ("shared memory", tp, "shm"),
            ("gloo", tp, "gloo"),
        ):
            # rank 0 decides the collectives for every rank (workers.join_shared_memory)
            workers.shm.available = available if collectives != "gloo" else lambda: False
            engine = LLMEngine(
                EngineConfig(
                    model=model,
                    dtype="float32",
                    quantization=None,
                    tensor_parallel_size=ranks,
                    max_num_seqs=max(batch_sizes),
                    max_model_len=512,
                    speculative_config={"method": "off"},
                )
            )
            for batch in batch_sizes:
                run(engine, prompts[:1], output_len, 1, [params])  # warm-up
                result = run(engine, prompts[:batch], output_len, batch, [params] * batch)
                texts[(label, batch)] = result["outputs"]
                steps[(label, batch)] = batch / result["tok_s"]  # seconds per decode step
            engine.shutdown()
            del engine
        workers.shm.available = available
    for batch in batch_sizes:
        one = steps[("one process", batch)]
        line = f"  batch {batch:3d}: one process {one * 1e3:7.1f} ms/step"
        for label in ("shared memory", "gloo"):
            ms = steps[(label, batch)]
            same = texts[(label, batch)] == texts[("one process", batch)]
            line += f"; {tp} ranks, {label} {ms * 1e3:7.1f} ms ({one / ms:.2f}x of one)"
            line += "" if same else " TEXT DIFFERS"
        print(line, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _load(
    engine: Any, rate: float, requests: int, output_len: int, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at ``rate``/s; TTFT from each request's send, tok/s over the run."""
    import asyncio
    import random

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttfts: list[float] = []
    texts: dict[int, list[int]] = {}
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        sent = time.perf_counter()
        prompt = f"Request {i}: write a short note about the number {i * 37 % 1000}."
        stream = await engine.add_request(prompt, params, f"r{seed}-{i}")
        first = True
        async for out in stream:
            if first:
                ttfts.append(time.perf_counter() - sent)
                first = False
            if out.finished:
                texts[i] = list(out.outputs[0].token_ids)
                tokens += len(out.outputs[0].token_ids)

    started = time.perf_counter()
    tasks = []
    for i in range(requests):
        tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - started
    return {"tok_s": tokens / seconds, "ttft": ttfts, "texts": texts}


def data_parallel(rates: list[float], requests: int, output_len: int) -> None:
    import asyncio

    from specbatch.engine.async_engine import AsyncEngine
    from specbatch.engine.data_parallel import DataParallelEngine

    config = EngineConfig(max_num_seqs=64, max_model_len=1024)
    results: dict[tuple[str, float], dict[str, Any]] = {}
    for label in ("one engine", "2 replicas"):
        if label == "one engine":
            engine: Any = AsyncEngine(config)
        else:
            engine = DataParallelEngine(config, 2)

        async def sweep(engine: Any = engine, label: str = label) -> None:
            engine.start()
            await _load(engine, rates[0], 4, 4, seed=99)  # warm-up
            for rate in rates:
                results[(label, rate)] = await _load(engine, rate, requests, output_len, 0)
            await engine.shutdown(1.0)

        asyncio.run(sweep())
        del engine
    for rate in rates:
        one, two = results[("one engine", rate)], results[("2 replicas", rate)]
        line = f"  {rate:5.1f} req/s:"
        for label, r in (("one engine", one), ("2 replicas", two)):
            line += (
                f"  {label} {r['tok_s']:7.1f} tok/s, TTFT p50 "
                f"{percentile(r['ttft'], 0.5) * 1e3:6.0f} ms p99 "
                f"{percentile(r['ttft'], 0.99) * 1e3:6.0f} ms;"
            )
        same = one["texts"] == two["texts"]
        line += f"  throughput {two['tok_s'] / one['tok_s']:.2f}x"
        print(line + ("" if same else "  TEXT DIFFERS"), flush=True)


def ray_batch(requests: int, output_len: int) -> None:
    import json
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "in.jsonl"
        with path.open("w") as f:
            for i in range(requests):
                body = {
                    "prompt": f"Line {i}: a few words about the number {i * 37 % 1000}.",
                    "max_tokens": output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions"}
                f.write(json.dumps({**line, "body": body}) + "\n")
        results = {}
        for label, extra in (
            ("one engine", []),
            ("--ray 2 replicas", ["--ray", "--replicas", "2"]),
        ):
            out = Path(scratch) / f"out-{len(results)}.jsonl"
            command = [sys.executable, "-m", "specbatch.cli", "run-batch", "-i", str(path)]
            command += ["-o", str(out), "--no-progress", "--max-num-seqs", "64", *extra]
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            seconds = time.perf_counter() - started
            texts = {}
            for raw in out.read_text().splitlines():
                record = json.loads(raw)
                texts[record["custom_id"]] = record["response"]["body"]["choices"][0]["text"]
            results[label] = (seconds, texts)
            print(
                f"  {label:18s} {seconds:6.1f} s wall ({requests * output_len / seconds:6.1f} "
                "tok/s, start-up included)",
                flush=True,
            )
    (one, one_texts), (ray, ray_texts) = results["one engine"], results["--ray 2 replicas"]
    print(
        f"  ray / one engine: {one / ray:.2f}x throughput; text "
        f"{'equal' if one_texts == ray_texts else 'DIFFERS'} on {len(one_texts)} lines",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["collectives", "step", "dp", "ray"],
        default=["collectives", "step", "dp", "ray"],
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--dp-requests", type=int, default=48)
    parser.add_argument("--dp-output-len", type=int, default=64)
    parser.add_argument("--ray-requests", type=int, default=1000)
    parser.add_argument("--ray-output-len", type=int, default=32)
    args = parser.parse_args()
    print_conditions(
        "scaling out on one host: collectives, tensor-parallel step, data-parallel replicas, Ray",
        cores=os.cpu_count(),
        parts=args.parts,
        ranks=args.ranks,
        repeats=args.repeats,
        tp=args.tp,
        batch_sizes=args.batch_sizes,
        output_len=args.output_len,
        shared_memory=shm.available(),
        rates=args.rates,
        dp_requests=args.dp_requests,
        dp_output_len=args.dp_output_len,
        ray_requests=args.ray_requests,
        ray_output_len=args.ray_output_len,
    )
    if "collectives" in args.parts:
        print("collectives (median, rank 0's clock):")
        for world in args.ranks:
            collectives(world, args.repeats)
    if "step" in args.parts:
        print(f"step: float32, speculation off, {args.tp} ranks (shared memory, gloo) and one:")
        step(args.tp, args.batch_sizes, args.output_len)
    if "dp" in args.parts:
        print(
            "data parallel: the default model and speculation; one engine on every core against "
            "2 replicas of one core, Poisson arrivals:"
        )
        data_parallel(args.rates, args.dp_requests, args.dp_output_len)
    if "ray" in args.parts:
        print(
            f"batch job: {args.ray_requests} lines, run-batch on one engine against --ray with "
            "2 replicas (the default model and speculation):"
        )
        ray_batch(args.ray_requests, args.ray_output_len)


if __name__ == "__main__":
    main()
