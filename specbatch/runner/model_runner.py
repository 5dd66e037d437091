"""Runs a model over a flat ragged batch and returns logits at the rows that need them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specbatch.models.llama import LlamaForCausalLM
from specbatch.runner.flat_batch import FlatBatch

if TYPE_CHECKING:  # triton is optional: only CUDA engines build graphs
    from specbatch.runner.cuda_graphs import CudaGraphRunner


class ModelRunner:
    """Owns the host-to-device step: metadata, one forward (a CUDA-graph replay when the step
    has a captured shape), logits at chosen rows only."""

    def __init__(self, model: LlamaForCausalLM, graphs: CudaGraphRunner | None = None) -> None:
        self.model = model
        self.device = model.device
        self.graphs = graphs

    def forward(self, batch: FlatBatch, logit_rows: np.ndarray) -> torch.Tensor:
        """Float32 logits ``[len(logit_rows), vocab]`` for a batch (K/V written to the cache)."""
        with torch.no_grad():
            if self.graphs is not None and self.graphs.can_run(batch):
                hidden = self.graphs.forward_hidden(batch)
            else:
                metadata = self.model.backend.build_metadata(batch.attention, self.device)
                input_ids = torch.from_numpy(batch.input_ids).to(self.device)
                positions = torch.from_numpy(batch.positions).to(self.device)
                hidden = self.model(input_ids, positions, metadata)
            every_row_in_order = len(logit_rows) == batch.num_tokens and bool(
                np.all(logit_rows == np.arange(batch.num_tokens))
            )
            if not every_row_in_order:
                hidden = hidden.index_select(0, torch.from_numpy(logit_rows).to(self.device))
            return self.model.compute_logits(hidden).float()
