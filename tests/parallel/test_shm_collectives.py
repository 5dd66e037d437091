"""Shared-memory collectives against gloo's, in real processes on one host.

Each case starts ``world`` processes that join a gloo group over a file store and the same
shared-memory segment, run both collectives on the same random tensors (every shape a
tensor-parallel SmolLM2 step exchanges: hidden rows of 1, 7 and 300 tokens, a vocabulary
slice of logits rows), and send back what each gave."""

from __future__ import annotations

import io
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specbatch.errors import TensorParallelError
from specbatch.models import shm_collectives as shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="shared-memory collectives: x86 only")

HIDDEN, VOCAB_SLICE = 576, 49152 // 3
SHAPES = [(1, HIDDEN), (7, HIDDEN), (300, HIDDEN), (5, VOCAB_SLICE), (1,)]
DTYPES = [torch.float32, torch.bfloat16]


def sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The slow, obvious reference of ``SharedMemoryGroup.all_reduce``."""
    total = parts[0].clone()
    for part in parts[1:]:
        total = total + part
    return total


def _inputs(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(shape, generator=generator) * 10 ** (rank % 3)).to(dtype)
        for dtype in DTYPES
        for shape in SHAPES
    ]


def _rank_main(
    rank: int, world: int, store: str, name: str, capacity: int, queue: Any, job: str
) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        if rank == 0:  # as the engine joins: rank 0 makes it, then the others attach
            group = shm.SharedMemoryGroup(name, 0, world, capacity, create=True, timeout=20)
        dist.barrier()
        if rank:
            group = shm.SharedMemoryGroup(name, rank, world, capacity, create=False, timeout=20)
        dist.barrier()
        group.unlink()
        if job == "die" and rank == 1:
            os._exit(3)  # a rank that dies without a word
        result: dict[str, Any] = {"reduced": [], "gloo": [], "gathered": [], "gloo_gathered": []}
        for tensor in _inputs(rank):
            mine = tensor.clone()
            result["reduced"].append(group.all_reduce(mine.clone()))
            reference = mine.clone()
            dist.all_reduce(reference)
            result["gloo"].append(reference)
            result["gathered"].append(group.all_gather(mine))
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            result["gloo_gathered"].append(parts)
        strided = torch.arange(12.0).view(3, 4).t() * (rank + 1)  # not contiguous
        result["strided"] = group.all_reduce(strided).clone()
        buffer = io.BytesIO()  # bytes, not tensors: a tensor in a queue dies with its sender
        torch.save(result, buffer)
        queue.put((rank, buffer.getvalue()))
        dist.barrier()
        group.close()
        dist.destroy_process_group()
    except TensorParallelError as exc:
        queue.put((rank, {"error": str(exc)}))
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()}))


def _run(world: int, tmp_path: Path, capacity: int, job: str = "compare") -> dict[int, Any]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    name = shm.new_name()
    store = str(tmp_path / "store")
    processes = [
        context.Process(
            target=_rank_main, args=(rank, world, store, name, capacity, queue, job), daemon=True
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + 120
    expected = world - 1 if job == "die" else world
    while len(results) < expected and time.monotonic() < deadline:
        rank, result = queue.get(timeout=max(deadline - time.monotonic(), 1))
        results[rank] = torch.load(io.BytesIO(result)) if isinstance(result, bytes) else result
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    if job != "die":
        for rank, result in results.items():
            assert "error" not in result, (rank, result["error"])
    assert not os.path.exists(os.path.join(shm.DIRECTORY, name))  # nothing left behind
    return results


@pytest.mark.parametrize("capacity", [1 << 20, 4096], ids=["whole", "chunked"])
def test_two_ranks_give_glooss_bits(tmp_path: Path, capacity: int) -> None:
    """Two ranks: the sum is gloo's bit for bit (x0 + x1 is x1 + x0), the gathered rows are
    each rank's own, on tensors cut into chunks of the segment's capacity too."""
    results = _run(2, tmp_path, capacity)
    for rank in range(2):
        result = results[rank]
        assert "error" not in result, result.get("error")
        for ours, theirs in zip(result["reduced"], result["gloo"], strict=True):
            assert ours.dtype == theirs.dtype
            assert torch.equal(ours, theirs)
        for ours, theirs in zip(result["gathered"], result["gloo_gathered"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        expected = sum(torch.arange(12.0).view(3, 4).t() * (r + 1) for r in range(2))
        assert torch.equal(result["strided"], expected)


def test_three_ranks_sum_in_rank_order_on_every_rank(tmp_path: Path) -> None:
    """Three ranks: every rank holds the same bits, the sum in rank order (the reference);
    gloo's ring sums in another order, equal to a rounding."""
    results = _run(3, tmp_path, 1 << 16)
    inputs = [_inputs(rank) for rank in range(3)]
    for rank in range(3):
        result = results[rank]
        assert "error" not in result, result.get("error")
        for i, (ours, theirs) in enumerate(zip(result["reduced"], result["gloo"], strict=True)):
            reference = sum_in_rank_order([inputs[r][i] for r in range(3)])
            assert torch.equal(ours, reference)
            assert torch.equal(ours, results[0]["reduced"][i])
            # two sums of three terms in other orders: each a couple of roundings apart
            scale = sum(inputs[r][i].float().abs() for r in range(3))
            eps = torch.finfo(ours.dtype).eps
            assert ((ours.float() - theirs.float()).abs() <= 2 * eps * scale).all()
        for i, gathered in enumerate(result["gathered"]):
            assert all(torch.equal(gathered[r], inputs[r][i]) for r in range(3))


def test_a_rank_that_dies_is_named_within_the_liveness_bound(tmp_path: Path) -> None:
    started = time.monotonic()
    results = _run(2, tmp_path, 1 << 16, job="die")
    assert time.monotonic() - started < 60
    assert "rank(s) [1] exited" in results[0]["error"]


def test_a_segment_of_another_shape_is_refused(tmp_path: Path) -> None:
    name = shm.new_name()
    group = shm.SharedMemoryGroup(name, 0, 2, 4096, create=True)
    try:
        with pytest.raises(TensorParallelError, match="expects"):
            shm.SharedMemoryGroup(name, 1, 3, 4096, create=False)
    finally:
        group.close()
    assert not os.path.exists(os.path.join(shm.DIRECTORY, name))
