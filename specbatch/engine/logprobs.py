"""Log-probabilities reported to users: the chosen token's and the top-n, with ranks.

They are those of the raw model distribution (log-softmax of the logits, before temperature,
penalties and truncation), as vLLM reports by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specbatch.kernels.sampling import raw_logprobs

# token id -> (logprob, rank among the vocabulary, 1 = most likely)
RankedLogprobs = dict[int, tuple[float, int]]


def ranked_logprobs(
    logits: torch.Tensor, chosen: Sequence[int], top_n: int
) -> list[RankedLogprobs]:
    """Per logits row: the chosen token and the ``top_n`` most likely ones."""
    rows = raw_logprobs(logits.view(-1, logits.shape[-1]))
    result = []
    for r, token in enumerate(chosen):
        row = rows[r]
        value = row[token]
        entries = {token: (float(value), int((row > value).sum()) + 1)}
        if top_n:
            values, ids = row.topk(top_n)
            for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), 1):
                entries.setdefault(t, (v, rank))
        result.append(entries)
    return result
