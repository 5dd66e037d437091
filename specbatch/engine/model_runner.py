"""Runs a model over a flat ragged batch and returns logits at the rows that need them."""

from __future__ import annotations

import numpy as np
import torch

from specbatch.engine.flat_batch import FlatBatch
from specbatch.models.llama import LlamaForCausalLM


class ModelRunner:
    """Owns the host-to-device step: metadata, one forward, logits at chosen rows only."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.device = model.device

    def forward(self, batch: FlatBatch, logit_rows: np.ndarray) -> torch.Tensor:
        """Float32 logits ``[len(logit_rows), vocab]`` for a batch (K/V written to the cache)."""
        metadata = self.model.backend.build_metadata(batch.attention, self.device)
        input_ids = torch.from_numpy(batch.input_ids).to(self.device)
        positions = torch.from_numpy(batch.positions).to(self.device)
        with torch.no_grad():
            hidden = self.model(input_ids, positions, metadata)
            every_row_in_order = len(logit_rows) == batch.num_tokens and bool(
                np.all(logit_rows == np.arange(batch.num_tokens))
            )
            if not every_row_in_order:
                hidden = hidden.index_select(0, torch.from_numpy(logit_rows).to(self.device))
            return self.model.compute_logits(hidden).float()
