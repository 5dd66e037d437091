"""One layer of paged attention on the CPU: the in-place C kernel against the reference backend.

Shapes of SmolLM2-135M (9 query heads, 3 KV heads, head dim 64, blocks of 16), contexts drawn
from the given range, blocks shuffled over the cache. Each case times the backend's ``forward``
(K/V write included) after a warm-up; the ratio is reference time over kernel time, measured in
the same process. Also prints the bytes of K/V the step must read and the bandwidth that makes.

    python benchmarks/cpu_attention.py [--repeats 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_conditions, write_json
from specbatch.kernels.attention import AttentionInputs
from specbatch.kernels.attention.cpu_paged import CpuPagedBackend
from specbatch.kernels.attention.torch_ref import TorchAttentionBackend

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def make_step(
    batch: int, query: int, low: int, high: int, dtype: torch.dtype, seed: int = 0
) -> tuple[AttentionInputs, list[torch.Tensor], int]:
    """A step of ``batch`` sequences, ``query`` new tokens each, over a shuffled cache."""
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(low, high + 1, batch)
    blocks = -(-seq_lens // BLOCK)
    order = rng.permutation(int(blocks.sum()))
    tables = np.zeros((batch, int(blocks.max())), dtype=np.int64)
    used = 0
    for b in range(batch):
        tables[b, : blocks[b]] = order[used : used + blocks[b]]
        used += blocks[b]
    positions = np.concatenate([np.arange(n - query, n) for n in seq_lens])
    owner = np.repeat(np.arange(batch), query)
    slots = tables[owner, positions // BLOCK] * BLOCK + positions % BLOCK
    inputs = AttentionInputs(np.full(batch, query), seq_lens, tables, slots.astype(np.int64), BLOCK)
    tokens = batch * query
    caches = [torch.randn(used, BLOCK, KV_HEADS, DIM).to(dtype) for _ in range(2)]
    qkv = [
        torch.randn(tokens, HEADS, DIM),
        torch.randn(tokens, KV_HEADS, DIM),
        torch.randn(tokens, KV_HEADS, DIM),
    ]
    kv_bytes = int(seq_lens.sum()) * KV_HEADS * DIM * caches[0].element_size() * 2
    return inputs, [*qkv, *caches], kv_bytes


def time_backend(
    backend: TorchAttentionBackend, inputs: AttentionInputs, tensors: list[torch.Tensor], n: int
) -> float:
    q, k, v, key_cache, value_cache = tensors
    metadata = backend.build_metadata(inputs, torch.device("cpu"))
    for _ in range(3):
        backend.forward(q, k, v, (key_cache, value_cache), metadata)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        backend.forward(q, k, v, (key_cache, value_cache), metadata)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print_conditions(
        "paged attention, one layer (median of repeats, K/V write included)",
        shape=f"{HEADS} heads / {KV_HEADS} KV heads, head dim {DIM}, block {BLOCK}",
        repeats=args.repeats,
    )
    cases = [
        ("decode b64 ctx 100-380", 64, 1, 100, 380),
        ("verify k=4 b64 ctx 100-380", 64, 5, 100, 380),
        ("decode b16 ctx 400-800", 16, 1, 400, 800),
        ("decode b1 ctx 2000", 1, 1, 2000, 2000),
        ("verify k=4 b1 ctx 600", 1, 5, 600, 600),
        ("prefill b4 of 128", 4, 128, 128, 128),
        ("prefill b1 of 700", 1, 700, 700, 700),
        ("chunk of 256 after 768", 1, 256, 1024, 1024),
    ]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, batch, query, low, high in cases:
            inputs, tensors, kv_bytes = make_step(batch, query, low, high, dtype)
            reference = TorchAttentionBackend(HEADS, KV_HEADS, DIM, DIM**-0.5)
            kernel = CpuPagedBackend(HEADS, KV_HEADS, DIM, DIM**-0.5)
            ref_s = time_backend(reference, inputs, tensors, args.repeats)
            kernel_s = time_backend(kernel, inputs, tensors, args.repeats)
            rows.append(
                {
                    "case": name,
                    "kv_dtype": str(dtype).removeprefix("torch."),
                    "reference_ms": ref_s * 1e3,
                    "kernel_ms": kernel_s * 1e3,
                    "speedup": ref_s / kernel_s,
                    "kernel_GBps": kv_bytes / kernel_s / 1e9,
                }
            )
    header = ("case", "KV", "reference ms", "kernel ms", "ratio", "GB/s")
    print("{:30s} {:9s} {:>12s} {:>10s} {:>7s} {:>6s}".format(*header))  # ratio: ref / kernel
    for r in rows:
        print(
            f"{r['case']:30s} {r['kv_dtype']:9s} {r['reference_ms']:12.3f} {r['kernel_ms']:10.3f}"
            f" {r['speedup']:6.2f}x {r['kernel_GBps']:6.1f}"
        )
    write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
