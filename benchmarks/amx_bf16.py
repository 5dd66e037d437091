"""bfloat16 products on AMX tiles (``kernels/amx_linear``) against oneDNN's packed bfloat16
linear.

    python benchmarks/amx_bf16.py [--rows 1 2 8 64 256] [--repeats 20]

Where the CPU has AMX, the bfloat16 mode multiplies with ``amx_linear`` (a product C can call,
with a row's bits independent of its batch, so its layers run fused). This times it on
SmolLM2-135M's shapes against oneDNN's bfloat16 product of the same values (what bfloat16 used
before, and still uses without AMX), each product alone (weights in cache), both rounding
their outputs to bfloat16, in the same run; it checks the error against float64 and each
row's bits at other row counts. Skips where the CPU has no AMX.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import median_seconds, print_conditions
from specbatch.kernels import amx_linear
from specbatch.kernels.amx_linear import TileWeight

SHAPES = {"qkv": (960, 576), "gate/up": (3072, 576), "down": (576, 1536), "lm head": (49152, 576)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not amx_linear.available():
        print("no AMX tiles on this CPU (or no compiler): nothing to time")
        return
    print_conditions(
        "AMX bfloat16 product (kernels/amx_linear) against oneDNN's packed bfloat16 linear",
        threads=torch.get_num_threads(),
        rows=args.rows,
        repeats=args.repeats,
    )

    generator = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=generator).bfloat16()
        tiles = TileWeight.from_dense(weight)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        x = torch.randn(max(args.rows), k, generator=generator).bfloat16()
        full = amx_linear.amx_linear(x, tiles)
        exact = x.double() @ weight.double().T
        error = float((full.double() - exact).abs().max() / exact.abs().max())
        same = all(
            torch.equal(amx_linear.amx_linear(x[:m].clone(), tiles), full[:m]) for m in args.rows
        )
        cells = []
        for m in args.rows:
            rows = x[:m].clone()
            amx = 1e6 * median_seconds(partial(amx_linear.amx_linear, rows, tiles), args.repeats)
            dnnl = 1e6 * median_seconds(
                partial(torch.ops.mkldnn._linear_pointwise, rows, onednn, None, "none", [], ""),
                args.repeats,
            )
            cells.append(f"{m}: {amx:.0f} / {dnnl:.0f} us ({dnnl / amx:.2f}x)")
        print(f"{name:8s} {n}x{k}: error {error:.1e}, row bits equal at every count: {same}")
        print("   rows: AMX / oneDNN us (oneDNN / AMX): " + "; ".join(cells))


if __name__ == "__main__":
    main()
