"""A slow, obvious paged attention: one query, one head, one key at a time through the block table.

Also builds random ragged steps (prefill from 0, prefill chunks at an offset, decodes, verify
queries) over shuffled block tables, for every backend's comparison tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specbatch.kernels.attention import PAD_SLOT, AttentionInputs


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    inputs: AttentionInputs,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Writes k/v into the caches (in place) and returns ``[T, heads * dim]`` in float32; with
    ``window`` a query at position p sees p - window + 1 .. p only, with ``softcap`` its
    scores are ``softcap * tanh(score / softcap)``."""
    block_size = inputs.block_size
    _, _, kv_heads, dim = key_cache.shape
    heads = q.shape[1] // dim
    group = heads // kv_heads
    for t, slot in enumerate(inputs.slot_mapping.tolist()):
        if slot != PAD_SLOT:
            key_cache[slot // block_size, slot % block_size] = k[t].view(kv_heads, dim)
            value_cache[slot // block_size, slot % block_size] = v[t].view(kv_heads, dim)
    out = torch.zeros(q.shape[0], heads, dim, dtype=torch.float32)
    starts = inputs.query_start_loc
    for b in range(len(inputs.query_lens)):
        q_len, seq_len = int(inputs.query_lens[b]), int(inputs.seq_lens[b])
        first_new = seq_len - q_len
        table = inputs.block_tables[b]
        for i in range(q_len):
            t = int(starts[b]) + i
            visible = list(range(first_new + i + 1))
            if window is not None:
                visible = [p for p in visible if p > first_new + i - window]
            if inputs.tree_mask is not None:
                visible = list(range(first_new)) + [
                    first_new + j for j in range(q_len) if inputs.tree_mask[t, j]
                ]
            keys = torch.stack([key_cache[table[p // block_size], p % block_size] for p in visible])
            values = torch.stack(
                [value_cache[table[p // block_size], p % block_size] for p in visible]
            )
            for h in range(heads):
                query = q[t].view(heads, dim)[h].float()
                scores = keys[:, h // group].float() @ query * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                weights = torch.softmax(scores, dim=0)
                out[t, h] = weights @ values[:, h // group].float()
    return out.view(q.shape[0], heads * dim)


@dataclass
class RandomStep:
    inputs: AttentionInputs
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor


def float32_reference(step: RandomStep, scale: float) -> torch.Tensor:
    """``reference_attention`` of a step computed in float32, whatever the step's dtype (a
    float32 step's own caches receive its K/V, as a backend's would)."""
    return reference_attention(
        step.q.float(),
        step.k.float(),
        step.v.float(),
        step.key_cache.float(),
        step.value_cache.float(),
        step.inputs,
        scale,
    )


def random_step(
    rng: np.random.Generator,
    kinds: list[str],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    tree: bool = False,
) -> RandomStep:
    """One ragged step; ``kinds`` entries: prefill, chunk, decode, verify, and long-decode and
    long-verify (contexts of 250-900 positions: several of the CPU kernel's chunks)."""
    query_lens, seq_lens = [], []
    for kind in kinds:
        if kind == "prefill":
            q_len, cached = int(rng.integers(17, 60)), 0
        elif kind == "chunk":
            q_len, cached = int(rng.integers(17, 40)), int(rng.integers(1, 50))
        elif kind == "decode":
            q_len, cached = 1, int(rng.integers(0, 70))
        elif kind == "long-decode":
            q_len, cached = 1, int(rng.integers(250, 900))
        elif kind == "long-verify":
            q_len, cached = int(rng.integers(2, 7)), int(rng.integers(250, 900))
        else:
            q_len, cached = int(rng.integers(2, 7)), int(rng.integers(1, 70))
        query_lens.append(q_len)
        seq_lens.append(cached + q_len)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    free = list(rng.permutation(num_blocks))
    tables = [[int(free.pop()) for _ in range(n)] for n in blocks_needed]
    width = max(blocks_needed)
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables])
    slots = []
    for table, q_len, seq_len in zip(tables, query_lens, seq_lens, strict=True):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    tree_mask = None
    if tree:
        tree_mask = np.zeros((len(slots), max(query_lens)), dtype=bool)
        t = 0
        for q_len in query_lens:
            for i in range(q_len):
                # a random ancestor set that always contains the token itself
                tree_mask[t, :i] = rng.random(i) < 0.5
                tree_mask[t, i] = True
                t += 1
    inputs = AttentionInputs(
        np.array(query_lens),
        np.array(seq_lens),
        block_tables,
        np.array(slots),
        block_size,
        tree_mask,
    )
    total = len(slots)
    cache_shape = (num_blocks, block_size, kv_heads, dim)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    return RandomStep(
        inputs=inputs,
        q=torch.randn(total, heads * dim, generator=gen).to(dtype),
        k=torch.randn(total, kv_heads * dim, generator=gen).to(dtype),
        v=torch.randn(total, kv_heads * dim, generator=gen).to(dtype),
        key_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        value_cache=torch.randn(cache_shape, generator=gen).to(dtype),
    )
