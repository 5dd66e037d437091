"""Batched logprob ranking against a per-row loop."""

from __future__ import annotations

import numpy as np
import torch

from specbatch.engine.logprobs import ranked_logprobs


def slow_ranked(logits: torch.Tensor, chosen: list[int], counts: list[int]) -> list[dict]:
    out = []
    for r, (token, n) in enumerate(zip(chosen, counts, strict=True)):
        row = torch.log_softmax(logits[r].float(), dim=-1)
        entries = {token: (float(row[token]), int((row > row[token]).sum()) + 1)}
        values, ids = row.topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), 1):
            entries.setdefault(t, (v, rank))
        out.append(entries)
    return out


def test_batched_equals_per_row() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        rows, vocab = int(rng.integers(1, 6)), int(rng.integers(2, 50))
        logits = torch.from_numpy(rng.normal(size=(rows, vocab)).astype(np.float32))
        chosen = rng.integers(0, vocab, rows).tolist()
        counts = rng.integers(0, min(vocab, 6), rows).tolist()
        assert ranked_logprobs(logits, chosen, counts) == slow_ranked(logits, chosen, counts)
        same = int(counts[0])
        assert ranked_logprobs(logits, chosen, same) == slow_ranked(logits, chosen, [same] * rows)
    assert ranked_logprobs(torch.zeros(0, 5), [], 3) == []
