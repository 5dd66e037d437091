"""Build the backend's launches for representative steps and compile them for a GPU target.

Run as ``python -m tests.kernels.compile_cases`` with a JSON list of cases on stdin (the test
does this in a process without ``TRITON_INTERPRET``); prints one JSON report per case.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import numpy as np
import torch

from specbatch.kernels.attention import PAD_SLOT, AttentionInputs
from specbatch.kernels.attention.triton_backend import TileConfig, TritonAttentionBackend
from tests.kernels.compile_report import CompileReport, compile_launch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def step_inputs(kind: str, block_size: int) -> AttentionInputs:
    """A step of ``kind``: decode (8 sequences), verify (k = 4), prefill, mixed."""
    query_lens = {
        "decode": [1] * 8,
        "verify": [5] * 8,
        "prefill": [300, 77],
        "mixed": [120, 1, 5, 1, 33],
    }[kind]
    seq_lens = [q + 200 for q in query_lens]
    blocks = [-(-s // block_size) for s in seq_lens]
    table = np.zeros((len(blocks), max(blocks)), dtype=np.int64)
    next_block = 0
    slots = []
    for row, (q, s, n) in enumerate(zip(query_lens, seq_lens, blocks, strict=True)):
        table[row, :n] = np.arange(next_block, next_block + n)[::-1]
        next_block += n
        for position in range(s - q, s):
            slots.append(table[row, position // block_size] * block_size + position % block_size)
    slots[0] = PAD_SLOT
    return AttentionInputs(
        np.array(query_lens), np.array(seq_lens), table, np.array(slots), block_size
    )


def compile_case(case: dict[str, Any]) -> list[CompileReport]:
    """Every launch of one layer's forward, tensors laid out as the model lays them out."""
    heads, kv_heads, dim = case["heads"], case["kv_heads"], case["dim"]
    dtype = DTYPES[case.get("dtype", "bf16")]
    backend = TritonAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    backend.softcap = case.get("softcap")
    if case.get("splits", 1) > 1:
        backend.force_splits = case["splits"]
    if case.get("decode_tiles"):
        backend.decode_tiles = TileConfig(*case["decode_tiles"])
    if case.get("prefill_tiles"):
        backend.prefill_tiles = TileConfig(*case["prefill_tiles"])
    inputs = step_inputs(case["kind"], case.get("block_size", 16))
    if case.get("tree"):
        width = int(inputs.query_lens.max())
        inputs.tree_mask = np.tril(np.ones((inputs.num_tokens, width), dtype=bool))
    metadata = backend.build_metadata(inputs, torch.device("cpu"))
    tokens = inputs.num_tokens
    qkv = torch.empty(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)  # the fused projection
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    num_blocks = int(inputs.block_tables.max()) + 1
    cache = torch.empty(2, num_blocks, inputs.block_size, kv_heads, dim, dtype=dtype)
    out = torch.empty(tokens, heads, dim, dtype=dtype)
    write = backend.write_launch(k, v, cache[0], cache[1], metadata)
    assert write is not None
    attention = backend.attention_launches(
        q, cache[0], cache[1], out, metadata, False, window=case.get("window")
    )
    launches = [write, *attention]
    return [compile_launch(launch, case["arch"]) for launch in launches]


def main() -> None:
    cases = json.load(sys.stdin)
    reports = {
        case["id"]: [dataclasses.asdict(report) for report in compile_case(case)] for case in cases
    }
    json.dump(reports, sys.stdout)


if __name__ == "__main__":
    main()
