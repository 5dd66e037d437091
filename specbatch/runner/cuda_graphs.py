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
from typing import Protocol

import numpy as np
import torch

from specbatch.kernels.attention import PAD_SLOT, AttentionInputs
from specbatch.kernels.attention.triton_backend import TritonAttentionBackend, TritonMetadata
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
    metadata: TritonMetadata
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
        if not isinstance(model.backend, TritonAttentionBackend):
            raise ValueError("CUDA graphs need the triton attention backend")
        self.backend: TritonAttentionBackend = model.backend
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
        backend = self.backend
        programs = backend.build_metadata(self._padded_inputs(batch, q), torch.device("cpu"))
        longest = self.max_blocks * self.block_size
        return backend.splits(len(programs.program_seq), longest, self.model.device)

    def _capture(self, batch: int, q: int, splits: int) -> _Graph:
        device = self.model.device
        metadata = self.backend.build_metadata(self._padded_inputs(batch, q), device)
        metadata.num_splits = splits
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
            q in self.query_lens
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
        m = g.metadata
        m.seq_lens[:real].copy_(torch.from_numpy(attention.seq_lens.astype(np.int32)))
        m.seq_lens[real:].fill_(q)
        kv_lens = attention.seq_lens if attention.kv_lens is None else attention.kv_lens
        m.kv_lens[:real].copy_(torch.from_numpy(kv_lens.astype(np.int32)))
        m.kv_lens[real:].fill_(q)
        # Only the columns this step reads: the table's rest is never read for these lengths
        # (and padding rows read their first block, zeroed).
        width = attention.block_tables.shape[1]
        m.block_tables[:real, :width].copy_(
            torch.from_numpy(attention.block_tables.astype(np.int32))
        )
        m.block_tables[real:, :1].zero_()
        m.slot_mapping[:tokens].copy_(torch.from_numpy(attention.slot_mapping.astype(np.int64)))
        m.slot_mapping[tokens:].fill_(PAD_SLOT)
        g.graph.replay()
        self.replays += 1
        self.split_replays += splits > 1
        return g.hidden[:tokens]
