"""What a verify step costs against a decode step, per batch size and weight mode.

    python benchmarks/verify_cost.py [--modes float32 bfloat16 gguf gguf-per-op]
        [--batch-sizes 1 4 8 16 32 64]

Speculation pays only when the tokens a verify step accepts outweigh what its extra rows cost.
For each batch size, every sequence gets a 200-token prompt, then the forward of one token per
sequence (a decode step) and of k + 1 tokens per sequence (a verify step of k drafts) are timed
on the same model and cache (the model's forward and logits for every row, as the engine runs
them). The ratio verify / decode is the number of tokens a verify step must yield per sequence
to break even (before the drafts' own cost). ``gguf-per-op`` is ``gguf`` with its fused layers
turned off (the per-op path: same bits, more Python).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import print_conditions, write_json
from specbatch.models import load_model
from specbatch.models.default_model import default_model_path
from tests.helpers import PagedHarness

MODES = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "gguf": {"dtype": "float32", "quantization": "gguf"},
    "gguf-per-op": {"dtype": "float32", "quantization": "gguf"},  # layers not fused
}


def step_times(mode: str, batch_sizes: list[int], k: int, repeats: int) -> list[dict[str, float]]:
    model = load_model(default_model_path(), **MODES[mode])  # type: ignore[arg-type]
    model.pack_for_cpu()
    if mode == "gguf-per-op":
        model.fused.enabled = False
        model.fused.reconsider()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batch_sizes:
        per_sequence = -(-(200 + 2 * repeats * (k + 2)) // 16)  # blocks, rounded up
        harness = PagedHarness(model, num_blocks=batch * per_sequence + 8)
        for seq in range(batch):
            harness.forward([(seq, torch.randint(100, 40000, (200,), generator=gen).tolist())])
        times = {}
        for tokens in (1, k + 1, 1, k + 1):  # warm both shapes, then time them
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                harness.forward([(seq, [7] * tokens) for seq in range(batch)])
                samples.append(time.perf_counter() - start)
            times[tokens] = statistics.median(samples) * 1e3
        rows.append(
            {
                "batch": batch,
                "decode_ms": times[1],
                "verify_ms": times[k + 1],
                "ratio": times[k + 1] / times[1],
            }
        )
        print(
            f"{mode:9s} batch {batch:3d}: decode {times[1]:7.1f} ms, verify k={k} "
            f"{times[k + 1]:7.1f} ms, ratio {times[k + 1] / times[1]:.2f}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--modes", nargs="+", default=["float32", "bfloat16", "gguf"], choices=list(MODES)
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print_conditions(
        "verify step against decode step (SmolLM2-135M, 200-token contexts)",
        modes=args.modes,
        batch_sizes=args.batch_sizes,
        k=args.k,
        repeats=args.repeats,
    )
    results = {
        mode: step_times(mode, args.batch_sizes, args.k, args.repeats) for mode in args.modes
    }
    write_json(args.json, results)


if __name__ == "__main__":
    main()
