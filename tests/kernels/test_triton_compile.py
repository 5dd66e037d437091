"""The Triton launches compiled for real GPUs (sm_80, sm_90) on the CPU, and what they use.

The interpreter that runs the kernels in the other tests accepts programs the compiler rejects
and says nothing about speed. Here every launch the backend makes for a representative step is
compiled by Triton for the GPU, with the ptxas shipped in Triton's wheel, from the very
arguments the backend passes, and the compiled code must: build; keep everything in registers
(no local-memory spills, the first thing that wrecks an attention kernel's speed); fit the
architecture's shared memory; load K/V through ``cp.async`` (software pipelining) for 16-bit
caches; use ``wgmma`` for prefill tiles on Hopper; store the KV write 16 bytes at a time.

All cases compile in one child process with ``TRITON_INTERPRET`` unset (see compile_report).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from specbatch.kernels.attention.triton_backend import (
    DECODE_TILES,
    PREFILL_TILES,
    TILE_CANDIDATES,
    TritonAttentionBackend,
)
from tests.kernels.compile_cases import step_inputs
from tests.kernels.compile_report import CompileReport

ROOT = Path(__file__).resolve().parents[2]
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes of shared memory per block
SHAPES = [(32, 8, 64), (32, 8, 128), (9, 3, 64), (8, 8, 128), (32, 4, 128)]  # GQA 4, 4, 3, 1, 8

MAIN = [
    {"id": f"{h}-{kv}-{d}-{kind}-{arch}", "heads": h, "kv_heads": kv, "dim": d, "kind": kind,
     "arch": arch}
    for arch in (90, 80)
    for kind in ("decode", "verify", "prefill")
    for h, kv, d in SHAPES
]  # fmt: skip
VARIANTS = [
    {"dtype": "fp16", "kind": "mixed"},
    {"dtype": "fp16", "kind": "decode", "splits": 4, "block_size": 32},
    {"dtype": "bf16", "kind": "verify", "tree": True},
    {"dtype": "bf16", "kind": "mixed", "tree": True, "block_size": 32},
    {"dtype": "fp32", "kind": "mixed"},
    {"dtype": "fp32", "kind": "decode", "splits": 3},
]
VARIANTS = [
    {"id": f"variant-{i}", "heads": 32, "kv_heads": 8, "dim": 128, "arch": 90, **v}
    for i, v in enumerate(VARIANTS)
]
# The new families' shapes: Gemma 3 270M's heads (4 of 256 dims, one KV head) with a sliding
# window, Gemma 2's soft-capped scores; Qwen3's 128-dim heads with a window
VARIANTS += [
    {"id": f"family-{i}-{arch}", "arch": arch, "dtype": "bf16", **v}
    for i, v in enumerate(
        [
            {"heads": 4, "kv_heads": 1, "dim": 256, "kind": "decode", "window": 512},
            {"heads": 4, "kv_heads": 1, "dim": 256, "kind": "prefill", "window": 512},
            {"heads": 4, "kv_heads": 1, "dim": 256, "kind": "mixed", "softcap": 50.0},
            {"heads": 16, "kv_heads": 8, "dim": 128, "kind": "verify", "window": 4096},
        ]
    )
    for arch in (90, 80)
]
# The tiles benchmarks/gpu_check.py times (the defaults are in MAIN).
CANDIDATES = [
    {"id": f"{kind}-{i}-{dim}", "heads": 32, "kv_heads": 8, "dim": dim, "kind": kind, "arch": 90,
     f"{kind}_tiles": dataclasses.astuple(tiles)}
    for kind in ("decode", "prefill")
    for i, tiles in enumerate(TILE_CANDIDATES[kind][1:])
    for dim in (64, 128)
]  # fmt: skip
# 128 x 64 tiles of 128-dim heads on 4 warps spill on sm_90: the check can fail.
SPILLING = {"id": "spilling", "heads": 32, "kv_heads": 8, "dim": 128, "kind": "prefill",
            "arch": 90, "prefill_tiles": [128, 64, 4, 3]}  # fmt: skip


@pytest.fixture(scope="module")
def reports() -> dict[str, list[CompileReport]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_cases"],
        input=json.dumps([*MAIN, *VARIANTS, *CANDIDATES, SPILLING]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=False,
    )
    if done.returncode != 0 and "NVIDIA tools" in done.stderr:
        pytest.skip("Triton's wheel has no ptxas/cuobjdump here")
    assert done.returncode == 0, done.stderr[-4000:]
    raw: dict[str, list[dict[str, Any]]] = json.loads(done.stdout)
    return {key: [CompileReport(**r) for r in value] for key, value in raw.items()}


def check(report: CompileReport, dtype: str = "bf16") -> None:
    assert report.stack_bytes == 0, f"{report.name} spills {report.stack_bytes} bytes/thread"
    assert report.shared_bytes <= SHARED_LIMIT[report.arch], report.shared_bytes
    if report.name == "paged_attention_kernel" and dtype != "fp32":
        assert report.pipelined_loads, "K/V tile loads are not pipelined (no cp.async)"


@pytest.mark.parametrize("case", MAIN, ids=[c["id"] for c in MAIN])
def test_launches_compile_without_spills(
    reports: dict[str, list[CompileReport]], case: dict[str, Any]
) -> None:
    got = reports[case["id"]]
    assert [r.name for r in got] == ["write_kv_kernel", "paged_attention_kernel"]
    for report in got:
        check(report)
    write, attention = got
    if case["arch"] == 90 and case["kind"] == "prefill":
        assert attention.uses_wgmma, "prefill tiles should use Hopper's wgmma"
    assert write.count("st.global.v4.b32") > 0, "the KV write should store 16 bytes at a time"


@pytest.mark.parametrize("case", VARIANTS, ids=[c["id"] for c in VARIANTS])
def test_other_variants_compile(
    reports: dict[str, list[CompileReport]], case: dict[str, Any]
) -> None:
    got = reports[case["id"]]
    names = ["write_kv_kernel", "paged_attention_kernel"]
    if case.get("splits", 1) > 1:
        names.append("reduce_splits_kernel")
    assert [r.name for r in got] == names
    for report in got:
        check(report, case["dtype"])


@pytest.mark.parametrize("case", CANDIDATES, ids=[c["id"] for c in CANDIDATES])
def test_candidate_tiles_compile_without_spills(
    reports: dict[str, list[CompileReport]], case: dict[str, Any]
) -> None:
    got = reports[case["id"]]
    # both launches compiled (an empty list would check nothing)
    assert [r.name for r in got] == ["write_kv_kernel", "paged_attention_kernel"]
    for report in got:
        check(report)


def test_spilling_tiles_are_caught(reports: dict[str, list[CompileReport]]) -> None:
    assert reports["spilling"][1].stack_bytes > 0


def test_default_tiles_are_the_ones_checked() -> None:
    backend = TritonAttentionBackend(32, 8, 64, 0.125)
    decode = backend.build_metadata(step_inputs("decode", 16), torch.device("cpu"))
    prefill = backend.build_metadata(step_inputs("prefill", 16), torch.device("cpu"))
    assert decode.tiles == DECODE_TILES
    assert prefill.tiles == PREFILL_TILES
