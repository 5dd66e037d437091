"""Causal attention over dense ``[batch, length]`` blocks, with no KV cache.

For training (autograd flows through it) and for scoring whole sequences (a distillation
teacher), where every sequence of the batch starts at position 0 and has the same length, so
paging would be pure overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specbatch.kernels.attention.base import AttentionBackend, AttentionInputs, LayerKVCache


@dataclass(frozen=True)
class DenseCausalMetadata:
    batch: int
    length: int


class DenseCausalBackend(AttentionBackend):
    """``forward`` treats the flat ``T = batch * length`` tokens as ``batch`` causal rows."""

    name = "dense_causal"

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> DenseCausalMetadata:
        lengths = set(inputs.query_lens.tolist()) | set(inputs.seq_lens.tolist())
        if len(lengths) != 1:
            raise ValueError("dense causal attention needs equal-length sequences from position 0")
        return DenseCausalMetadata(len(inputs.query_lens), lengths.pop())

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache | None,
        metadata: DenseCausalMetadata,
    ) -> torch.Tensor:
        b, n = metadata.batch, metadata.length
        group = self.num_heads // self.num_kv_heads
        q4 = q.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k4 = k.reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v4 = v.reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if group > 1:
            k4 = k4.repeat_interleave(group, dim=1)
            v4 = v4.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=self.scale)
        return out.transpose(1, 2).reshape(b * n, self.num_heads, self.head_dim)
