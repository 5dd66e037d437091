"""A separate, smaller draft model as a drafting network (``drafting.NetworkProposer``).

Its own paged K/V lives on the target's block ids and block size, so the target's allocation
(with its lookahead slots) governs both. Its cache rows at draft positions hold the draft's
own computation of those tokens, valid wherever the target accepted them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from specbatch.cache.kv_tensors import allocate_kv_caches
from specbatch.models.llama import LlamaForCausalLM
from specbatch.runner.flat_batch import FlatBatch, TokenRun, flatten
from specbatch.runner.model_runner import ModelRunner
from specbatch.sequence import Sequence
from specbatch.spec_decode.proposers.draft_trees import TreeLevel
from specbatch.spec_decode.proposers.drafting import DraftNetwork

if TYPE_CHECKING:  # triton is optional: only CUDA engines build graphs
    from specbatch.runner.cuda_graphs import CudaGraphRunner


class DraftModelNetwork(DraftNetwork):
    """A Llama-family draft model run over its own paged cache."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        capture_graphs: Callable[[], CudaGraphRunner | None] | None = None,
    ) -> None:
        """``capture_graphs`` builds CUDA graphs for the single-token draft forwards; it is
        called once the cache is bound (graphs capture the cache's addresses)."""
        self.model = model
        self._capture_graphs = capture_graphs
        self.block_size = 0
        self.runner: ModelRunner | None = None

    def bind_cache(self, num_blocks: int, block_size: int) -> None:
        model = self.model
        model.bind_kv_caches(
            allocate_kv_caches(model.config, num_blocks, block_size, model.dtype, model.device)
        )
        self.block_size = block_size
        graphs = self._capture_graphs() if self._capture_graphs else None
        self.runner = ModelRunner(model, block_size, graphs)

    def draft_logits(self, runs: list[TokenRun], seqs: list[Sequence], step: int) -> torch.Tensor:
        batch = flatten(runs, self.block_size)
        return self._logits(batch, batch.query_start[1:] - 1)

    def level_logits(
        self, runs: list[TokenRun], levels: list[TreeLevel], wanted: list[list[int]]
    ) -> torch.Tensor:
        batch = flatten(runs, self.block_size)
        rows = np.concatenate(
            [batch.query_start[b] + np.asarray(w, dtype=np.int64) for b, w in enumerate(wanted)]
        )
        return self._logits(batch, rows)

    def _logits(self, batch: FlatBatch, rows: np.ndarray) -> torch.Tensor:
        assert self.runner is not None, "bind_cache first"
        return self.model.logits_in_output_vocab(self.runner.forward(batch, rows))
