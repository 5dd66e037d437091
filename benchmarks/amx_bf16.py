"""A row-invariant bfloat16 product on AMX tiles against oneDNN's packed bfloat16 linear.

    python benchmarks/amx_bf16.py [--rows 1 2 8 64 256] [--repeats 20]

The bfloat16 mode's layers cannot run as one C call (as float32's and gguf's do) because
torch exports no bfloat16 product C can call whose row bits do not depend on the batch
(oneDNN's C API is hidden; MKL's ``cblas_gemm_bf16bf16f32`` is not row-invariant). This times
the groundwork for one (``amx_bf16.c``: TDPBF16PS over 2x2 tiles, every output accumulated
over K in the same order at any row count) on SmolLM2-135M's shapes against oneDNN's bfloat16
product of the same values, each product alone (weights in cache), in the same run; it checks
the error against float64 and each row's bits at other row counts. Skips where the CPU has no
AMX. Not used by the engine yet.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import print_conditions
from specbatch.kernels.cbuild import NATIVE_FLAGS, load_c_library

SOURCE = Path(__file__).with_name("amx_bf16.c")
SHAPES = {"qkv": (960, 576), "gate/up": (3072, 576), "down": (576, 1536), "lm head": (49152, 576)}


def median_us(run: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    library = load_c_library(SOURCE, NATIVE_FLAGS, "the AMX bfloat16 probe", "nothing to time")
    if library is None or not library.amx_available():
        print("no AMX tiles on this CPU (or no compiler): nothing to time")
        return
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.pack_b.argtypes = [pointer, i64, i64, pointer]
    library.amx_gemm.argtypes = [pointer, i64, i64, pointer, i64, pointer, ctypes.c_int]
    threads = torch.get_num_threads()
    print_conditions(
        "AMX bfloat16 product (amx_bf16.c) against oneDNN's packed bfloat16 linear",
        threads=threads,
        rows=args.rows,
        repeats=args.repeats,
    )

    def product(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
        out = torch.empty(x.shape[0], n)
        library.amx_gemm(
            x.data_ptr(), x.shape[0], x.shape[1], tiles.data_ptr(), n, out.data_ptr(), threads
        )
        return out

    generator = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=generator).bfloat16()
        tiles = torch.empty(-(-n // 16) * (k // 32) * 512, dtype=torch.int16)
        library.pack_b(weight.data_ptr(), n, k, tiles.data_ptr())
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        x = torch.randn(max(args.rows), k, generator=generator).bfloat16()
        full = product(x, tiles, n)
        exact = x.double() @ weight.double().T
        error = float((full.double() - exact).abs().max() / exact.abs().max())
        same = all(torch.equal(product(x[:m].clone(), tiles, n), full[:m]) for m in args.rows)
        cells = []
        for m in args.rows:
            rows = x[:m].clone()
            amx = median_us(partial(product, rows, tiles, n), args.repeats)
            dnnl = median_us(
                partial(torch.ops.mkldnn._linear_pointwise, rows, onednn, None, "none", [], ""),
                args.repeats,
            )
            cells.append(f"{m}: {amx:.0f} / {dnnl:.0f} us ({dnnl / amx:.2f}x)")
        print(f"{name:8s} {n}x{k}: error {error:.1e}, row bits equal at every count: {same}")
        print("   rows: AMX / oneDNN us (oneDNN / AMX): " + "; ".join(cells))


if __name__ == "__main__":
    main()
