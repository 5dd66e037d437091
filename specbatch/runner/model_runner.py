"""Runs a model over a flat ragged batch and returns logits at the rows that need them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from specbatch.cache.kv_tensors import move_slots
from specbatch.kernels.attention import GroupedMetadata
from specbatch.models.llama import LlamaForCausalLM
from specbatch.runner.flat_batch import FlatBatch, LogitRows, TokenRun, flatten

if TYPE_CHECKING:  # triton is optional: only CUDA engines build graphs
    from specbatch.runner.cuda_graphs import CudaGraphRunner


class ModelRunner:
    """Owns the host-to-device step: the step's shape (padding for CUDA graphs), metadata, one
    forward (a CUDA-graph replay when the step has a captured shape), logits at chosen rows."""

    def __init__(
        self, model: LlamaForCausalLM, block_size: int, graphs: CudaGraphRunner | None = None
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.graphs = graphs
        # with ``keep_hidden`` (a draft head reads the target's features) each forward keeps
        # its final-norm hidden states of every row and the batch's row offsets per run
        self.keep_hidden = False
        self.hidden: tuple[torch.Tensor, np.ndarray] | None = None

    def execute(self, runs: Sequence[TokenRun], rows: LogitRows) -> torch.Tensor:
        """Float32 logits ``[len(rows.run), vocab]`` for one step of ``runs``."""
        batch = flatten(self._shaped(runs), self.block_size)
        return self.forward(batch, rows.flat(batch.query_start))

    def move_slots(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy the K/V of cache slots ``sources`` to ``targets`` in every layer."""
        move_slots(
            self.model.kv_caches(),
            torch.tensor(sources, dtype=torch.long),
            torch.tensor(targets, dtype=torch.long),
        )

    def _shaped(self, runs: Sequence[TokenRun]) -> Sequence[TokenRun]:
        """Under CUDA graphs a decode-only step with any draft pads every decode to k drafts
        (one graph shape, q = k + 1); a step without drafts stays at q = 1. Steps that cannot
        replay anyway (a prefill chunk, more sequences than the ladder) are not padded."""
        graphs = self.graphs
        if (
            graphs is None
            or len(runs) > graphs.batch_sizes[-1]
            or not any(r.num_drafts for r in runs)
            or not all(r.is_decode for r in runs)
            or any(r.draft_parents is not None for r in runs)  # graphs have no tree mask
        ):
            return runs
        k = max(graphs.query_lens) - 1
        return [r.with_fillers(k) for r in runs]

    def forward(self, batch: FlatBatch, logit_rows: np.ndarray) -> torch.Tensor:
        """Float32 logits ``[len(logit_rows), vocab]`` for a batch (K/V written to the cache)."""
        with torch.no_grad():
            if self.graphs is not None and self.graphs.can_run(batch):
                hidden = self.graphs.forward_hidden(batch)
            else:
                metadata = self.model.backend.build_metadata(batch.attention, self.device)
                if batch.window_attention is not None:  # the sliding layers' cache group
                    window = self.model.backend.build_metadata(batch.window_attention, self.device)
                    metadata = GroupedMetadata(metadata, window)
                input_ids = torch.from_numpy(batch.input_ids).to(self.device)
                positions = torch.from_numpy(batch.positions).to(self.device)
                hidden = self.model(input_ids, positions, metadata)
            if self.keep_hidden:
                self.hidden = (hidden, batch.query_start)
            every_row_in_order = len(logit_rows) == batch.num_tokens and bool(
                np.all(logit_rows == np.arange(batch.num_tokens))
            )
            if not every_row_in_order:
                hidden = hidden.index_select(0, torch.from_numpy(logit_rows).to(self.device))
            return self.model.compute_logits(hidden).float()
