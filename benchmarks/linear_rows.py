"""A float32 linear layer's time by row count, in four weight layouts, same run.

    python benchmarks/linear_rows.py

SmolLM2-135M's linear shapes, 30 layers' worth (fused QKV 576->960, gate/up 576->3072,
o 576->576, down 1536->576), random weights, the rows a decode (1) or a verify (1 + drafts)
gives them. MKL's packed GEMM (``kernels.sgemm``, the model's float32 path where torch exports
it) and oneDNN's packed weights (``kernels.linear``, the path otherwise; one row is computed as
two) against torch's ``F.linear`` (MKL, the weight as stored) and ``x @ W^T`` with the
transpose made contiguous once. On some CPUs and BLAS builds
the time is not monotonic in the rows (a step-time model linear in tokens cannot follow
that); this prints what this machine does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_seconds, print_conditions
from specbatch.kernels import sgemm
from specbatch.kernels.onednn import cpu_packing_supported, pack_weight, packed_linear
from specbatch.kernels.sgemm import SgemmWeight, sgemm_linear

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
        mkl_packed_gemm=sgemm.available(),
    )
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) for _ in range(LAYERS) for out, inp in SHAPES]
    transposed = [w.t().contiguous() for w in weights]
    packed = [pack_weight(w) for w in weights] if cpu_packing_supported(torch.float32) else []
    mkl = [SgemmWeight.from_dense(w) for w in weights] if sgemm.available() else []
    header = ("rows", "MKL packed ms", "oneDNN ms", "F.linear ms", "x @ W^T ms")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (4, 13, 10, 12, 11), strict=True)))
    for m in rows:
        inputs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}

        def mkl_path(x: dict[int, torch.Tensor] = inputs) -> object:
            return [sgemm_linear(x[w.in_features], w) for w in mkl]

        def model_path(x: dict[int, torch.Tensor] = inputs) -> object:
            return [
                packed_linear(x[w.shape[1]], p, None, w.shape[0])
                for w, p in zip(weights, packed, strict=True)
            ]

        def linear(x: dict[int, torch.Tensor] = inputs) -> object:
            return [torch.nn.functional.linear(x[w.shape[1]], w) for w in weights]

        def matmul(x: dict[int, torch.Tensor] = inputs) -> object:
            return [x[t.shape[0]] @ t for t in transposed]

        missing = {mkl_path: not mkl, model_path: not packed}
        ms = [
            float("nan") if missing.get(fn) else 1000 * median_seconds(fn, 15)
            for fn in (mkl_path, model_path, linear, matmul)
        ]
        print(f"{m:>4} {ms[0]:>13.2f} {ms[1]:>10.2f} {ms[2]:>12.2f} {ms[3]:>11.2f}")


if __name__ == "__main__":
    main()
