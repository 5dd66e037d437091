"""CUDA graphs for decode and verify steps.

A step whose sequences all have the same query length q (q = 1 for plain decoding, q = k + 1
for verifying k drafts) has a fixed shape once the batch is padded to one of a ladder of sizes.
For every (batch size, q) the model forward is captured once over static input, position and
attention-metadata tensors; a replay copies the step's values into them (padding sequences get
slot -1, so they write nothing, and a block table of zeros) and launches the whole forward as
one graph. Logits are computed outside the graph, on the rows the step needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from specbatch.kernels.attention import PAD_SLOT, AttentionInputs
from specbatch.models.llama import LlamaForCausalLM
from specbatch.runner.flat_batch import FlatBatch

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class Replayable(Protocol):
    def replay(self) -> None: ...


Forward = Callable[[], torch.Tensor]
Capture = Callable[[Forward], tuple[Replayable, torch.Tensor]]


class CudaCapture:
    """Captures a forward into a CUDA graph (after two warm-up runs: Triton compiles, the
    allocator settles); all graphs share one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Forward) -> tuple[Replayable, torch.Tensor]:
        for _ in range(2):
            forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        return graph, out


@dataclass
class _Graph:
    graph: Replayable
    input_ids: torch.Tensor  # [B * q]
    positions: torch.Tensor  # [B * q]
    metadata: Any  # the backend's, captured: refreshed by prepare_for_replay
    hidden: torch.Tensor  # [B * q, hidden] (the captured output)


class CudaGraphRunner:
    """Captures and replays uniform decode/verify forwards of one model."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int,
        max_blocks_per_seq: int,
        query_lens: tuple[int, ...],
        max_batch: int,
        capture: Capture | None = None,
    ) -> None:
        if not model.backend.supports_cuda_graphs:
            raise ValueError(f"the {model.backend.name} attention backend cannot run in graphs")
        self.backend = model.backend
        self.model = model
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.query_lens = query_lens
        # the ladder up to max_batch, and max_batch itself so the fullest steps replay too
        self.batch_sizes = sorted({b for b in BATCH_LADDER if b < max_batch} | {max_batch})
        self.graphs: dict[tuple[int, int, int], _Graph] = {}  # (batch, q, splits)
        self.long_splits: dict[tuple[int, int], int] = {}  # (batch, q) -> split-KV graph's count
        self.replays = 0
        self.split_replays = 0  # of which with split-KV
        # Tests pass a stand-in that re-runs the forward on replay, to check the plumbing on CPU.
        self._capture_forward = capture or CudaCapture(model.device)

    def capture(self) -> None:
        """Capture every (batch size, query length, split count), largest first so memory is
        shared. A shape whose programs leave the GPU idle gets a second graph with split-KV for
        long contexts (the split count is a constant of the captured kernels)."""
        for q in self.query_lens:
            for batch in sorted(self.batch_sizes, reverse=True):
                self.graphs[(batch, q, 1)] = self._capture(batch, q, 1)
                long = self._long_context_splits(batch, q)
                if long > 1:
                    self.graphs[(batch, q, long)] = self._capture(batch, q, long)
                    self.long_splits[(batch, q)] = long

    def _padded_inputs(self, batch: int, q: int) -> AttentionInputs:
        return AttentionInputs(
            query_lens=np.full(batch, q),
            seq_lens=np.full(batch, q),
            block_tables=np.zeros((batch, self.max_blocks), dtype=np.int64),
            slot_mapping=np.full(batch * q, PAD_SLOT),
            block_size=self.block_size,
        )

    def _long_context_splits(self, batch: int, q: int) -> int:
        longest = self.max_blocks * self.block_size
        return self.backend.graph_splits(self._padded_inputs(batch, q), longest, self.model.device)

    def _capture(self, batch: int, q: int, splits: int) -> _Graph:
        device = self.model.device
        metadata = self.backend.prepare_for_capture(self._padded_inputs(batch, q), device, splits)
        input_ids = torch.zeros(batch * q, dtype=torch.long, device=device)
        positions = torch.zeros(batch * q, dtype=torch.long, device=device)
        with torch.no_grad():
            graph, hidden = self._capture_forward(
                lambda: self.model(input_ids, positions, metadata)
            )
        return _Graph(graph, input_ids, positions, metadata, hidden)

    def can_run(self, batch: FlatBatch) -> bool:
        lens = batch.attention.query_lens
        if len(lens) == 0 or len(lens) > self.batch_sizes[-1]:
            return False
        q = int(lens[0])
        return (
            batch.attention.tree_mask is None
            and q in self.query_lens
            and bool((lens == q).all())
            and (batch.attention.block_tables.shape[1] <= self.max_blocks)
        )

    def forward_hidden(self, batch: FlatBatch) -> torch.Tensor:
        """Hidden states of the step's real tokens, ``[T, hidden]``, through a graph replay."""
        attention = batch.attention
        real = len(attention.query_lens)
        q = int(attention.query_lens[0])
        size = next(b for b in self.batch_sizes if b >= real)
        splits = 1
        if int(attention.seq_lens.max()) >= self.backend.long_context:
            splits = self.long_splits.get((size, q), 1)
        g = self.graphs[(size, q, splits)]
        tokens = real * q
        g.input_ids[:tokens].copy_(torch.from_numpy(batch.input_ids), non_blocking=True)
        g.input_ids[tokens:].zero_()
        g.positions[:tokens].copy_(torch.from_numpy(batch.positions), non_blocking=True)
        g.positions[tokens:].zero_()
        self.backend.prepare_for_replay(g.metadata, attention)
        g.graph.replay()
        self.replays += 1
        self.split_replays += splits > 1
        return g.hidden[:tokens]
