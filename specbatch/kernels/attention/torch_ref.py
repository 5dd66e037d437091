"""Pure-torch paged attention: the reference backend, and the CPU path.

Per step, sequences are packed into padded groups: every sequence with a short query (decodes and
verify queries, at most ``SHORT_QUERY`` tokens) shares one group, every longer query (a prefill
chunk) gets its own. Per group, one ``index_select`` gathers its keys and values from the paged
cache through precomputed slot indices and one ``scaled_dot_product_attention`` call attends with a
boolean mask holding the causal offset. All index and mask tensors are built once per step, so a
layer costs a handful of torch calls whatever the batch size.

Grouped-query attention folds the query heads that share a KV head into the query-length axis
(``[B, kv_heads, group * L, D]``), so repeated K/V are never materialised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specbatch.kernels.attention.base import (
    PAD_SLOT,
    AttentionBackend,
    AttentionInputs,
    LayerKVCache,
)

SHORT_QUERY = 16
"""Queries up to this length are padded into one shared group; longer ones attend alone."""


@dataclass
class _Group:
    num_seqs: int
    query_len: int  # padded
    kv_len: int  # padded
    q_rows: torch.Tensor | None  # [num_seqs * query_len] flat rows; None: rows are 0..T-1
    kv_slots: torch.Tensor  # [num_seqs * kv_len] cache slots to read
    mask: torch.Tensor  # [num_seqs, 1, group * query_len, kv_len] bool, True = attend
    padded_valid: torch.Tensor | None  # rows of the padded output that are real tokens
    out_rows: torch.Tensor | None  # the flat rows those real tokens belong to
    q_pos: np.ndarray | None = None  # [num_seqs, query_len] positions (None: a tree's rows)
    group_size: int = 1  # query heads per KV head (folded into the mask's rows)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # masks by window

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer that sees ``window`` positions up to its own (None: all)."""
        if window is None:
            return self.mask
        if self.q_pos is None:
            raise ValueError("tree-shaped queries cannot attend a sliding window")
        if window not in self.windowed:
            j = np.arange(self.kv_len)
            inside = j[None, None, :] > self.q_pos[:, :, None] - window  # [G, Lq, kv]
            folded = torch.from_numpy(inside)[:, None].expand(
                self.num_seqs, self.group_size, self.query_len, self.kv_len
            )
            folded = folded.reshape(self.mask.shape).to(self.mask.device)
            windowed = self.mask & folded
            windowed[..., 0] |= ~windowed.any(-1)  # padded rows attend one key (no NaN)
            self.windowed[window] = windowed
        return self.windowed[window]


@dataclass
class TorchAttentionMetadata:
    """Per-step index tensors of :class:`TorchAttentionBackend`."""

    num_tokens: int
    write_rows: torch.Tensor | None  # tokens whose K/V are written; None: all of them
    write_slots: torch.Tensor
    groups: list[_Group]


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain torch; correct on any device, fast enough on the CPU."""

    name = "torch"

    def build_metadata(
        self, inputs: AttentionInputs, device: torch.device
    ) -> TorchAttentionMetadata:
        return self.reference_metadata(inputs, device)

    def reference_metadata(
        self, inputs: AttentionInputs, device: torch.device, groups: bool = True
    ) -> TorchAttentionMetadata:
        """The writes and the attention groups; without ``groups``, only the writes (another
        path attends every query)."""
        slots = np.asarray(inputs.slot_mapping, dtype=np.int64)
        written = slots != PAD_SLOT
        all_written = bool(written.all())
        write_rows = None if all_written else _tensor(np.flatnonzero(written), device)
        attention_groups: list[_Group] = []
        query_lens = np.asarray(inputs.query_lens, dtype=np.int64)
        short = np.flatnonzero(query_lens <= SHORT_QUERY)
        if len(short) and groups:
            attention_groups.append(self._build_group(inputs, short, device))
        for b in np.flatnonzero(query_lens > SHORT_QUERY) if groups else ():
            attention_groups.append(self._build_group(inputs, np.array([b]), device))
        return TorchAttentionMetadata(
            num_tokens=inputs.num_tokens,
            write_rows=write_rows,
            write_slots=_tensor(slots if all_written else slots[written], device),
            groups=attention_groups,
        )

    def _build_group(
        self, inputs: AttentionInputs, seqs: np.ndarray, device: torch.device
    ) -> _Group:
        query_lens = inputs.query_lens[seqs].astype(np.int64)
        seq_lens = inputs.seq_lens[seqs].astype(np.int64)
        starts = inputs.query_start_loc[seqs]
        q_len, kv_len = int(query_lens.max()), int(seq_lens.max())
        i = np.arange(q_len)
        j = np.arange(kv_len)
        q_valid = i[None, :] < query_lens[:, None]  # [G, Lq]
        q_rows = np.where(q_valid, starts[:, None] + i[None, :], 0)

        block_of = np.minimum(j // inputs.block_size, inputs.block_tables.shape[1] - 1)
        block_ids = inputs.block_tables[seqs][:, block_of].astype(np.int64)
        kv_valid = j[None, :] < seq_lens[:, None]
        kv_slots = np.where(kv_valid, block_ids * inputs.block_size + j % inputs.block_size, 0)

        first_new = seq_lens - query_lens  # position of each sequence's first query token
        q_pos = first_new[:, None] + i[None, :]
        mask = j[None, None, :] <= q_pos[:, :, None]
        if inputs.tree_mask is not None:
            mask = self._apply_tree_mask(mask, inputs.tree_mask, q_rows, query_lens, first_new)
        mask &= q_valid[:, :, None]
        mask[:, :, 0] |= ~q_valid  # padded query rows attend one key instead of none (no NaN)
        group = self.num_heads // self.num_kv_heads
        folded = torch.from_numpy(mask)[:, None].expand(len(seqs), group, q_len, kv_len)
        folded = folded.reshape(len(seqs), 1, group * q_len, kv_len)

        identity = bool(q_valid.all()) and np.array_equal(
            q_rows.reshape(-1), np.arange(inputs.num_tokens)
        )
        return _Group(
            num_seqs=len(seqs),
            query_len=q_len,
            kv_len=kv_len,
            q_rows=None if identity else _tensor(q_rows.reshape(-1), device),
            kv_slots=_tensor(kv_slots.reshape(-1), device),
            mask=folded.to(device),
            padded_valid=None if identity else _tensor(np.flatnonzero(q_valid), device),
            out_rows=None if identity else _tensor(q_rows[q_valid], device),
            q_pos=None if inputs.tree_mask is not None else q_pos,
            group_size=group,
        )

    @staticmethod
    def _apply_tree_mask(
        mask: np.ndarray,
        tree_mask: np.ndarray,
        q_rows: np.ndarray,
        query_lens: np.ndarray,
        first_new: np.ndarray,
    ) -> np.ndarray:
        """Replace the causal rule among each sequence's new tokens with its tree mask."""
        num_seqs, q_len, _ = mask.shape
        n = np.arange(q_len)
        width = min(q_len, tree_mask.shape[1])
        allowed = np.zeros((num_seqs, q_len, q_len), dtype=bool)
        allowed[..., :width] = tree_mask[q_rows][..., :width]
        shape = allowed.shape
        is_new = np.broadcast_to(n[None, None, :] < query_lens[:, None, None], shape)
        seq_idx = np.broadcast_to(np.arange(num_seqs)[:, None, None], shape)[is_new]
        row_idx = np.broadcast_to(n[None, :, None], shape)[is_new]
        cols = np.broadcast_to((first_new[:, None] + n[None, :])[:, None, :], shape)[is_new]
        mask[seq_idx, row_idx, cols] = allowed[is_new]
        return mask

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache | None,
        metadata: TorchAttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if kv_cache is None:
            raise RuntimeError("no KV cache bound to the model: call bind_kv_caches first")
        self.write_kv(k, v, kv_cache, metadata)
        out = self.attend_groups(q, kv_cache, metadata.groups, window=window)
        if out is None:
            out = q.new_zeros(q.shape[0], self.num_heads, self.head_dim)
        return out

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: TorchAttentionMetadata,
    ) -> None:
        """The step's new K/V into their slots (padding rows skipped)."""
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        if metadata.write_rows is not None:
            k = k.index_select(0, metadata.write_rows)
            v = v.index_select(0, metadata.write_rows)
        key_cache.index_copy_(0, metadata.write_slots, k.to(key_cache.dtype))
        value_cache.index_copy_(0, metadata.write_slots, v.to(value_cache.dtype))

    def attend_groups(
        self,
        q: torch.Tensor,
        kv_cache: LayerKVCache,
        groups: list[_Group],
        out: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor | None:
        """Attention for the query rows of ``groups`` (each seeing the last ``window``
        positions up to its own, or all), written into ``out`` (allocated when a group does not
        cover every row and none is given); the output, or None without groups."""
        num_tokens = q.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        group = heads // kv_heads
        key_cache = kv_cache[0].view(-1, kv_heads, dim)
        value_cache = kv_cache[1].view(-1, kv_heads, dim)
        for g in groups:
            qg = q if g.q_rows is None else q.index_select(0, g.q_rows)
            qg = qg.reshape(g.num_seqs, g.query_len, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
            qg = qg.reshape(g.num_seqs, kv_heads, group * g.query_len, dim)
            kg = key_cache.index_select(0, g.kv_slots).view(g.num_seqs, g.kv_len, kv_heads, dim)
            vg = value_cache.index_select(0, g.kv_slots).view(g.num_seqs, g.kv_len, kv_heads, dim)
            og = _attention(
                qg,
                kg.transpose(1, 2).to(q.dtype),
                vg.transpose(1, 2).to(q.dtype),
                g.mask_for(window),
                self.scale,
                self.softcap,
            )
            og = og.view(g.num_seqs, kv_heads, group, g.query_len, dim).permute(0, 3, 1, 2, 4)
            og = og.reshape(g.num_seqs * g.query_len, heads, dim)
            if g.q_rows is None:
                out = og
                continue
            if out is None:
                out = q.new_empty(num_tokens, heads, dim)
            assert g.padded_valid is not None
            assert g.out_rows is not None
            out.index_copy_(0, g.out_rows, og.index_select(0, g.padded_valid))
        return out


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Masked attention: SDPA, or with soft-capped scores the same steps written out."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    weights = scores.masked_fill(~mask, float("-inf")).float().softmax(-1).to(q.dtype)
    return torch.matmul(weights, v)


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)
