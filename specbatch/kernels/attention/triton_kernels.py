"""Triton kernels: paged FlashAttention-style attention over a ragged batch, and the KV write.

One attention program handles ``BLOCK_Q`` consecutive query tokens of one sequence for one KV
head, with all ``GROUP`` query heads sharing that KV head folded into its rows (row
``r = token * GROUP + head``), so grouped-query attention reads each K/V tile once and never
materialises repeated heads. It walks the sequence's KV positions in tiles of ``BLOCK_N`` through
the block table, keeps an online softmax (running max and sum) in float32 and accumulates
``P @ V`` in float32. Query token ``i`` of a sequence sits at position
``seq_len - query_len + i`` and sees positions up to its own (the causal offset), which serves
prefill from 0, prefill chunks at an offset, single-token decodes and ``k + 1``-token verify
queries alike. An optional tree mask replaces the causal rule among a sequence's new tokens.
Trailing filler tokens (past ``kv_len``, computed only to keep a CUDA graph's shape) are neither
computed (their rows are zeros) nor read.

Split-KV ("flash decoding"): with ``NUM_SPLITS > 1`` each program covers one slice of the KV
positions and writes its unnormalised partial result with its max and sum; ``reduce_splits``
combines them. It pays for few long sequences, where one program per (query block, head) would
leave most of the GPU idle.

Written for Triton 3.x; tested on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_k_token,
    stride_v_token,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_POW2: tl.constexpr,
):
    """Copy token ``t``'s K and V rows into cache slot ``slot_mapping[t]`` (skip slot -1)."""
    token = tl.program_id(0).to(tl.int64)  # token * stride overflows int32 on big steps
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offsets = tl.arange(0, ROW_POW2)
        mask = offsets < ROW
        key = tl.load(k_ptr + token * stride_k_token + offsets, mask=mask)
        value = tl.load(v_ptr + token * stride_v_token + offsets, mask=mask)
        tl.store(key_cache_ptr + slot * ROW + offsets, key, mask=mask)
        tl.store(value_cache_ptr + slot * ROW + offsets, value, mask=mask)


@triton.jit
def paged_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    kv_lens_ptr,
    query_start_ptr,
    program_seq_ptr,
    program_qstart_ptr,
    tree_mask_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale,
    window,  # positions a query sees, itself included (HAS_WINDOW)
    softcap,  # scores become softcap tanh(score / softcap) (HAS_SOFTCAP)
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_bt_seq,
    stride_tree_token,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_POW2: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: next power of two >= BLOCK_Q * GROUP, >= 16
    BLOCK_N: tl.constexpr,  # KV positions per tile
    NUM_SPLITS: tl.constexpr,
    HAS_TREE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,  # a sliding layer's (never with a tree)
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for exact float32, "tf32" for speed
    DOT_FP32: tl.constexpr,  # upcast 16-bit tiles before tl.dot (the CPU interpreter needs it)
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(program_seq_ptr + program)
    q_first = tl.load(program_qstart_ptr + program)  # first query index within the sequence
    seq_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - seq_start
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_len = tl.load(kv_lens_ptr + seq)  # positions holding K/V: trailing fillers excluded
    first_new = seq_len - query_len  # position of the sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    q_index = q_first + rows // GROUP  # query index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_index < query_len)  # rows to store
    row_real = row_valid & (first_new + q_index < kv_len)  # rows to compute (fillers: zeros)
    q_pos = first_new + q_index
    dims = tl.arange(0, HEAD_DIM_POW2)
    dim_valid = dims < HEAD_DIM

    token = (seq_start + q_index).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_real[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # KV positions this program reads: up to the last query's position, this split's share,
    # never a filler's (unwritten: stale or never-set memory, which 0 * NaN would let in).
    last_pos = tl.minimum(first_new + q_first + BLOCK_Q, kv_len)
    per_split = tl.cdiv(tl.cdiv(last_pos, BLOCK_N), NUM_SPLITS) * BLOCK_N
    kv_begin = split * per_split
    kv_end = tl.minimum(kv_begin + per_split, last_pos)
    if HAS_WINDOW:  # tiles before the first query's window: nothing to see there
        lowest = tl.maximum(first_new + q_first - window + 1, 0)
        kv_begin = tl.maximum(kv_begin, lowest // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_POW2], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(kv_begin, kv_end, BLOCK_N):
        kv_pos = start + cols
        kv_valid = kv_pos < kv_end
        block = tl.load(
            block_table_ptr + seq * stride_bt_seq + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0
        ).to(tl.int64)
        slot = block * BLOCK_SIZE + kv_pos % BLOCK_SIZE
        kv_offset = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
        kv_mask = kv_valid[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + kv_offset, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offset, mask=kv_mask, other=0.0)

        if DOT_FP32:
            q_tile, k_tile, v_tile = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        else:
            q_tile, k_tile, v_tile = q, k, v
        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * scale
        if HAS_SOFTCAP:  # tanh(y) = 1 - 2 / (exp(2y) + 1)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        visible = row_real[:, None] & kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        if HAS_TREE:
            new = kv_pos[None, :] - first_new  # which new token a column is (if >= 0)
            tree = tl.load(
                tree_mask_ptr + token[:, None] * stride_tree_token + tl.maximum(new, 0),
                mask=row_real[:, None] & (new >= 0) & (new < query_len),
                other=0,
            )
            visible = visible & ((new < 0) | (tree != 0))
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION
        ).to(tl.float32)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr
            + token[:, None] * stride_o_token
            + head[:, None] * stride_o_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        # partials laid out [program, kv_head, split, row(, dim)]
        base = ((program * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split) * BLOCK_M
        tl.store(part_max_ptr + base + rows, m_i)
        tl.store(part_sum_ptr + base + rows, l_i)
        tl.store(part_out_ptr + (base + rows[:, None]) * HEAD_DIM_POW2 + dims[None, :], acc)


@triton.jit
def reduce_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    program_seq_ptr,
    program_qstart_ptr,
    query_start_ptr,
    stride_o_token,
    stride_o_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_POW2: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Combine the split-KV partials of one (program, kv_head) into the final output."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(program_seq_ptr + program)
    q_first = tl.load(program_qstart_ptr + program)
    seq_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - seq_start
    rows = tl.arange(0, BLOCK_M)
    q_index = q_first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_index < query_len)
    dims = tl.arange(0, HEAD_DIM_POW2)

    base = (program * NUM_KV_HEADS + kv_head) * NUM_SPLITS * BLOCK_M
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        m_all = tl.maximum(m_all, tl.load(part_max_ptr + base + split * BLOCK_M + rows))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_POW2], tl.float32)
    for split in range(NUM_SPLITS):
        offset = base + split * BLOCK_M
        weight = tl.exp(tl.load(part_max_ptr + offset + rows) - m_safe)
        total += tl.load(part_sum_ptr + offset + rows) * weight
        part = tl.load(part_out_ptr + (offset + rows[:, None]) * HEAD_DIM_POW2 + dims[None, :])
        acc += part * weight[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    token = (seq_start + q_index).to(tl.int64)
    tl.store(
        out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :],
    )
