"""Scaling out on one host: the tensor-parallel collectives alone, and the step.

    python benchmarks/scale_out.py [--ranks 2 3] [--tp 3] [--batch-sizes 1 16]

``collectives``: ``--ranks`` processes joined by gloo (a file store) and one shared-memory
segment (``specbatch/models/shm_collectives.py``); each times, on the same tensors, gloo's
``all_reduce`` and the segment's (the hidden rows of 1, 16 and 256 tokens of SmolLM2, float32)
and both all-gathers of a logits row's vocabulary slice, median of ``--repeats`` after a
warm-up, rank 0's clock. Ratios are gloo's time over the segment's, same processes, same run.

``step``: the default model (float32: tensor-parallel ranks are not quantized) with
``--tp`` ranks against one process, speculation off (``{"method": "off"}``), greedy, EOS
ignored, ``--output-len`` tokens for each of ``--batch-sizes`` prompts at once; tok/s and the
ratio to one process in the same run. On a 2-core host the ranks share the cores (each gets
``cores / ranks`` threads), so this measures what the collectives and the per-rank overhead
cost, not a speed-up.
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


def step(tp: int, batch_sizes: list[int], output_len: int) -> None:
    prompts = [[1, 504, 3360, 282, 1638, 30, 28, 100 + i] for i in range(max(batch_sizes))]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rates: dict[tuple[int, int], float] = {}
    texts: dict[tuple[int, int], list[list[int]]] = {}
    for ranks in (1, tp):
        engine = LLMEngine(
            EngineConfig(
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
            texts[(ranks, batch)], rates[(ranks, batch)] = result["outputs"], result["tok_s"]
        engine.shutdown()
        del engine
    for batch in batch_sizes:
        one, many = rates[(1, batch)], rates[(tp, batch)]
        same = texts[(1, batch)] == texts[(tp, batch)]
        print(
            f"  batch {batch:3d}: 1 process {one:7.1f} tok/s, {tp} ranks {many:7.1f} tok/s "
            f"({many / one:.2f}x){'' if same else '  TEXT DIFFERS'}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--skip-step", action="store_true")
    args = parser.parse_args()
    print_conditions(
        "scaling out on one host: collectives alone, then the tensor-parallel step",
        cores=os.cpu_count(),
        ranks=args.ranks,
        repeats=args.repeats,
        tp=args.tp,
        batch_sizes=args.batch_sizes,
        output_len=args.output_len,
        shared_memory=shm.available(),
    )
    print("collectives (median, rank 0's clock):")
    for world in args.ranks:
        collectives(world, args.repeats)
    if not args.skip_step:
        print(f"step: SmolLM2-135M float32, speculation off, {args.tp} ranks against 1:")
        step(args.tp, args.batch_sizes, args.output_len)


if __name__ == "__main__":
    main()
