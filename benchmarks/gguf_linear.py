"""GGUF Q4_1 / Q8_0 linear kernels (the panels, and AMX tiles where the CPU has them) against
oneDNN's packed float32 (and bfloat16) linear and the AMX bfloat16 kernel.

SmolLM2-135M's shapes: the Q4_1 projections (576->576, 576->192, 576->1536, 1536->576) and the
Q8_0 LM head (576->49152), for M rows of input. Random weights are quantized blocks; the float
baselines hold the same values dequantised. Two regimes, per call, median of repeats, all
kernels in the same run:

* ``hot``: the same weight every call, so it stays in cache (a microbenchmark's best case);
* ``stream``: each call takes the next of enough copies of the weight that their total exceeds
  ``--stream-mb`` per kernel, so the weights come from memory, as in decoding a whole model,
  where every layer's weights are read once per token.

Ratios are each contender's time over the GGUF form the exact mode uses here (``tiles`` where
AMX is granted, else ``quant``, the panels): above 1, that form is faster.

    python benchmarks/gguf_linear.py [--repeats 20] [--rows 1 2 5 16 64] [--stream-mb 128]
                                     [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_seconds, print_conditions, write_json
from specbatch.kernels import amx_linear, gguf_tiles
from specbatch.kernels.gguf_linear import BLOCK_BYTES, QuantizedWeight, quantized_linear
from specbatch.kernels.gguf_tiles import TileBlockWeight, tile_block_linear
from specbatch.kernels.onednn import cpu_packing_supported, pack_weight, packed_linear

SHAPES = [  # (kind, in_features, out_features, what)
    ("q4_1", 576, 576, "q/o proj"),
    ("q4_1", 576, 192, "k/v proj"),
    ("q4_1", 576, 1536, "gate/up proj"),
    ("q4_1", 1536, 576, "down proj"),
    ("q8_0", 576, 49152, "LM head"),
]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith("model name")), "")
    except OSError:
        line = ""
    return line.partition(":")[2].strip() or "unknown"


def random_blocks(rng: np.random.Generator, kind: str, n: int, k: int) -> np.ndarray:
    """uint8 [n, k / 32 * block bytes]: fp16 scales of a trained model's size, random codes."""
    blocks = k // 32
    d = (rng.random((n, blocks, 1)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
    if kind == "q8_0":
        codes = rng.integers(0, 256, (n, blocks, 32), dtype=np.uint8)
        return np.concatenate([d, codes], axis=-1).reshape(n, -1)
    m = (-rng.random((n, blocks, 1)) * 0.1).astype(np.float16).view(np.uint8)
    codes = rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8)
    return np.concatenate([d, m, codes], axis=-1).reshape(n, -1)


def median_us(calls: Callable[[], object], repeats: int) -> float:
    return median_seconds(calls, repeats) * 1e6


@dataclass
class Contender:
    """A kernel, the input dtype it takes, and its weights: one copy, or enough copies to stream
    through (the rotation carries on across calls, so no copy is met again while in cache)."""

    name: str
    dtype: torch.dtype
    run: Callable[[torch.Tensor, Any], torch.Tensor]
    next_weight: Callable[[], Any]

    def time_us(self, x: torch.Tensor, repeats: int) -> float:
        xd = x.to(self.dtype)
        return median_us(lambda: self.run(xd, self.next_weight()), repeats)


def _copies(form: Any, count: int) -> list[Any]:
    """``form`` and ``count - 1`` copies of it with their own bytes (a dataclass with ``data``)."""
    return [form] + [dataclasses.replace(form, data=form.data.clone()) for _ in range(count - 1)]


def contenders(
    weight: QuantizedWeight, raw: np.ndarray, stream_bytes: int, bf16: bool
) -> list[Contender]:
    """The quantized kernels and the packed float ones, each with copies enough to exceed
    ``stream_bytes`` (one copy for 0)."""
    n, k = weight.out_features, weight.in_features

    def copies(nbytes: int) -> int:
        return max(1, -(-stream_bytes // nbytes))

    quantized = _copies(weight, copies(weight.nbytes))
    found = [
        Contender("quant", torch.float32, quantized_linear, itertools.cycle(quantized).__next__)
    ]
    if gguf_tiles.available():
        tiles = TileBlockWeight.from_blocks(raw, weight.kind, k)
        copies_of_tiles = _copies(tiles, copies(tiles.nbytes))
        found.append(
            Contender(
                "tiles", torch.float32, tile_block_linear, itertools.cycle(copies_of_tiles).__next__
            )
        )
    dense = weight.dequantize()
    if amx_linear.available():
        amx = [
            amx_linear.TileWeight.from_dense(dense.to(torch.bfloat16))
            for _ in range(copies(dense.numel() * 2))
        ]
        found.append(
            Contender(
                "amx_bf16",
                torch.bfloat16,
                lambda x, w: w.multiply(x),
                itertools.cycle(amx).__next__,
            )
        )
    for name, dtype in [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if bf16 else []):
        packed = [
            pack_weight(dense.to(dtype).clone())
            for _ in range(copies(dense.numel() * dtype.itemsize))
        ]

        def run(x: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
            return packed_linear(x, packed_weight, None, n)

        found.append(Contender(name, dtype, run, itertools.cycle(packed).__next__))
    return found


def measure_shape(
    kind: str, k: int, n: int, args: argparse.Namespace, bf16: bool
) -> list[dict[str, Any]]:
    raw = random_blocks(np.random.default_rng(0), kind, n, k)
    weight = QuantizedWeight.from_blocks(raw, kind, k)
    results = []
    for regime, stream_bytes in (("hot", 0), ("stream", args.stream_mb << 20)):
        timed = contenders(weight, raw, stream_bytes, bf16)
        for m in args.rows:
            x = torch.randn(m, k)
            row: dict[str, Any] = {"shape": f"{k}->{n}", "kind": kind, "regime": regime, "M": m}
            for contender in timed:
                row[f"{contender.name}_us"] = contender.time_us(x, args.repeats)
            exact = row.get("tiles_us", row["quant_us"])
            row["exact_GBps"] = weight.nbytes / exact / 1e3
            results.append(row)
            print_row(row, [c.name for c in timed])
    return results


def print_row(row: dict[str, Any], names: list[str]) -> None:
    exact = row.get("tiles_us", row["quant_us"])
    line = f"{row['kind']:5s} {row['shape']:>10s} {row['regime']:6s} {row['M']:3d}"
    for name in names:
        us = row[f"{name}_us"]
        line += f" {us:9.1f} {us / exact:5.2f}x"
    print(line + f" {row['exact_GBps']:7.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16, 64])
    parser.add_argument("--stream-mb", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16 = cpu_packing_supported(torch.bfloat16)
    print_conditions(
        "GGUF quantized linear vs packed float linear (median us per call)",
        cpu=cpu_model(),
        bytes_per_block=BLOCK_BYTES,
        repeats=args.repeats,
        stream_working_set=f"{args.stream_mb} MiB per kernel",
        bf16_baseline=bf16,
    )
    names = ["quant"] + ["tiles"] * gguf_tiles.available() + ["amx_bf16"] * amx_linear.available()
    names += ["fp32"] + ["bf16"] * bf16
    print(
        f"{'kind':5s} {'shape':>10s} {'regime':6s} {'M':>3s}"
        + "".join(f" {name + ' us':>9s} {'ratio':>6s}" for name in names)
        + "  exact GB/s"
    )
    results = []
    for kind, k, n, _ in SHAPES:
        results += measure_shape(kind, k, n, args, bf16)
    write_json(args.json, {"rows": results})


if __name__ == "__main__":
    main()
