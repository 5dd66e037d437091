"""Causal attention over dense ``[batch, length]`` blocks, with no KV cache.

For training (autograd flows through it) and for scoring whole sequences (a distillation
teacher), where every sequence of the batch starts at position 0 and has the same length, so
paging would be pure overhead.

:class:`DraftPassMetadata` trains a one-layer draft head on its own chained drafts as the
engine runs them (EAGLE-3's "training-time test"). Pass 1 is every position drafted from the
target's features: plain causal attention. In use, the j-th draft of a chain that starts after
position ``p - j + 1`` attends the cache up to there (K/V of rows computed from the target's
features: pass 1) and then the chain's own earlier rows. So pass ``j``'s query at position ``p``
attends pass 1's K/V at positions ``<= p - j + 1`` and pass ``i``'s K/V at position
``p - j + i`` for ``i = 2..j`` (its own at ``p``): one causal band plus ``j - 1`` diagonals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specbatch.kernels.attention.base import AttentionBackend, AttentionInputs, LayerKVCache


@dataclass(frozen=True)
class DenseCausalMetadata:
    batch: int
    length: int


@dataclass
class DraftPassMetadata:
    """Dense rows run as successive draft passes of a one-layer head: each forward is the next
    pass, and appends its K/V to ``passes`` (so one object serves all passes of a batch)."""

    batch: int
    length: int
    passes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


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
        metadata: DenseCausalMetadata | DraftPassMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        b, n = metadata.batch, metadata.length
        group = self.num_heads // self.num_kv_heads
        q4 = q.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k4 = k.reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v4 = v.reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if group > 1:
            k4 = k4.repeat_interleave(group, dim=1)
            v4 = v4.repeat_interleave(group, dim=1)
        if window is not None and window < n:  # a sliding layer's band of the causal mask
            if isinstance(metadata, DraftPassMetadata):
                raise ValueError("draft passes over a sliding window are not supported")
            band = torch.ones(n, n, dtype=torch.bool, device=q.device).tril().triu(1 - window)
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=band, scale=self.scale)
        elif isinstance(metadata, DraftPassMetadata) and metadata.passes:
            out = draft_pass_attention(q4, k4, v4, metadata.passes, self.scale)
        else:
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=self.scale)
        if isinstance(metadata, DraftPassMetadata):
            metadata.passes.append((k4, v4))
        return out.transpose(1, 2).reshape(b * n, self.num_heads, self.head_dim)


def draft_pass_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    earlier: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """Pass ``j = len(earlier) + 1`` (see the module docstring); ``[batch, heads, n, d]`` each,
    the earlier passes' K/V in order. Row ``p`` always sees its own key, so no row is empty."""
    j = len(earlier) + 1
    n = q.shape[2]
    first_k, first_v = earlier[0]
    scores = torch.matmul(q, first_k.transpose(-1, -2)) * scale  # [b, h, n, n]
    band = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-(j - 1))
    scores = scores.masked_fill(~band, float("-inf"))
    keys = [*earlier[1:], (k, v)]  # passes 2..j: the diagonal at p - j + i
    shifted_v = []
    diagonal = []
    for i, (ki, vi) in enumerate(keys, start=2):
        shift = j - i
        ks, vs = _shift_rows(ki, shift), _shift_rows(vi, shift)
        d = (q * ks).sum(-1) * scale  # [b, h, n]
        if shift:
            d[..., :shift] = float("-inf")  # before position 0
        diagonal.append(d)
        shifted_v.append(vs)
    weights = torch.cat([scores, torch.stack(diagonal, -1)], -1).float().softmax(-1).to(q.dtype)
    out = torch.matmul(weights[..., :n], first_v)
    for i, vs in enumerate(shifted_v):
        out = out + weights[..., n + i, None] * vs
    return out


def _shift_rows(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Row ``p`` of the result is row ``p - shift`` of ``x`` (zeros before 0), ``x`` [.., n, d]."""
    if shift == 0:
        return x
    return torch.cat([torch.zeros_like(x[..., :shift, :]), x[..., :-shift, :]], dim=-2)
