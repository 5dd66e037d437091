"""A float32 linear layer's time by row count, in three weight layouts, same run.

    python benchmarks/linear_rows.py

SmolLM2-135M's linear shapes, 30 layers' worth (fused QKV 576->960, gate/up 576->3072,
o 576->576, down 1536->576), random weights, the rows a decode (1) or a verify (1 + drafts)
gives them. The model's path (``kernels.linear``: weights packed once for oneDNN; one row is
computed as two) against torch's ``F.linear`` (MKL, the weight as stored) and ``x @ W^T``
with the transpose made contiguous once. On some CPUs and BLAS builds
the time is not monotonic in the rows (a step-time model linear in tokens cannot follow
that); this prints what this machine does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_seconds, print_conditions
from specbatch.kernels.linear import cpu_packing_supported, pack_weight, packed_linear

SHAPES = [(960, 576), (3072, 576), (576, 576), (576, 1536)]  # (out, in)
LAYERS = 30


def main() -> None:
    rows = [int(r) for r in sys.argv[1:]] or [1, 2, 3, 4, 5, 6, 8, 16]
    print_conditions(
        "float32 linear layers by row count (SmolLM2-135M shapes)",
        layers=LAYERS,
        shapes=SHAPES,
        rows=rows,
        onednn_packing=cpu_packing_supported(torch.float32),
    )
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) for _ in range(LAYERS) for out, inp in SHAPES]
    transposed = [w.t().contiguous() for w in weights]
    packed = [pack_weight(w) for w in weights] if cpu_packing_supported(torch.float32) else []
    print(f"{'rows':>4} {'packed ms':>10} {'F.linear ms':>12} {'x @ W^T ms':>11}")
    for m in rows:
        inputs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}

        def model_path(x: dict[int, torch.Tensor] = inputs) -> object:
            return [
                packed_linear(x[w.shape[1]], p, None, w.shape[0])
                for w, p in zip(weights, packed, strict=True)
            ]

        def linear(x: dict[int, torch.Tensor] = inputs) -> object:
            return [torch.nn.functional.linear(x[w.shape[1]], w) for w in weights]

        def matmul(x: dict[int, torch.Tensor] = inputs) -> object:
            return [x[t.shape[0]] @ t for t in transposed]

        ms = [
            1000 * median_seconds(fn, 15) if packed or fn is not model_path else float("nan")
            for fn in (model_path, linear, matmul)
        ]
        print(f"{m:>4} {ms[0]:>10.2f} {ms[1]:>12.2f} {ms[2]:>11.2f}")


if __name__ == "__main__":
    main()
