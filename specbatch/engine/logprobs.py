"""Log-probabilities reported to users: the chosen token's and the top-n, with ranks.

They are those of the raw model distribution (log-softmax of the logits, before temperature,
penalties and truncation), as vLLM reports by default. All rows of a call are ranked on the
device together and come back in one transfer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specbatch.kernels.sampling import raw_logprobs

# token id -> (logprob, rank among the vocabulary, 1 = most likely)
RankedLogprobs = dict[int, tuple[float, int]]


def ranked_logprobs(
    logits: torch.Tensor, chosen: Sequence[int], top_n: int | Sequence[int]
) -> list[RankedLogprobs]:
    """Per logits row: the chosen token and its row's ``top_n`` most likely ones (one count
    for every row, or one per row)."""
    if not chosen:
        return []
    counts = [top_n] * len(chosen) if isinstance(top_n, int) else list(top_n)
    rows = raw_logprobs(logits.view(-1, logits.shape[-1])[: len(chosen)])
    tokens = torch.tensor(chosen, dtype=torch.long, device=rows.device)
    values = rows.gather(1, tokens[:, None])
    ranks = (rows > values).sum(1, keepdim=True) + 1
    columns = [values.double(), ranks.double()]
    most = max(counts)
    if most:
        top_values, top_ids = rows.topk(most, dim=1)
        columns += [top_values.double(), top_ids.double()]  # ids < 2**53: exact as float64
    packed = torch.cat(columns, dim=1).tolist()  # the one device-to-host transfer
    result = []
    for token, n, row in zip(chosen, counts, packed, strict=True):
        entries = {token: (row[0], int(row[1]))}
        for rank in range(1, n + 1):
            entries.setdefault(int(row[1 + most + rank]), (row[1 + rank], rank))
        result.append(entries)
    return result
