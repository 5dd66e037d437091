"""Flattening token runs: positions and cache slots against a per-token loop."""

from __future__ import annotations

import numpy as np
import pytest

from specbatch.kernels.attention import PAD_SLOT
from specbatch.runner.flat_batch import LogitRows, TokenRun, flatten


def slow_slots(runs: list[TokenRun], block_size: int) -> list[int]:
    slots = []
    for run in runs:
        real = len(run.token_ids) - run.num_unslotted
        for i in range(len(run.token_ids)):
            position = run.start_position + i
            if i >= real:
                slots.append(PAD_SLOT)
            else:
                block = run.block_table[position // block_size]
                slots.append(block * block_size + position % block_size)
    return slots


def test_random_runs_match_a_per_token_loop() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        block_size = int(rng.choice([4, 16]))
        runs = []
        for _ in range(int(rng.integers(0, 6))):
            start = int(rng.integers(0, 40))
            count = int(rng.integers(1, 9))
            unslotted = int(rng.integers(0, count)) if rng.random() < 0.5 else 0
            held = -(-(start + count - unslotted) // block_size)  # blocks of the real tokens
            table = rng.permutation(100)[:held].tolist()
            runs.append(TokenRun(list(range(count)), start, table, num_unslotted=unslotted))
        batch = flatten(runs, block_size)
        assert batch.attention.slot_mapping.tolist() == slow_slots(runs, block_size)
        expected_positions = [r.start_position + i for r in runs for i in range(len(r.token_ids))]
        assert batch.positions.tolist() == expected_positions
        kv_lens = [r.start_position + len(r.token_ids) - r.num_unslotted for r in runs]
        if any(r.num_unslotted for r in runs):
            assert batch.attention.kv_lens is not None
            assert batch.attention.kv_lens.tolist() == kv_lens
        else:
            assert batch.attention.kv_lens is None
        # the table covers every attended position; what lies past a run's blocks is block 0
        tables = batch.attention.block_tables
        for row, run in enumerate(runs):
            needed = -(-(run.start_position + len(run.token_ids)) // block_size)
            assert tables.shape[1] >= needed
            assert tables[row, : len(run.block_table)].tolist() == list(run.block_table)
            assert not tables[row, len(run.block_table) :].any()


def test_a_real_token_past_its_blocks_is_refused() -> None:
    """Only fillers may lie past a sequence's blocks; a real one would write block 0."""
    flatten([TokenRun([1, 2, 3], 15, [7], num_unslotted=2)], 16)  # fillers: fine
    with pytest.raises(ValueError, match="past its sequence's blocks"):
        flatten([TokenRun([1, 2, 3], 15, [7], num_unslotted=1)], 16)


def test_fillers_pad_a_decode_to_k_drafts_and_logit_rows_follow_the_runs() -> None:
    decode = TokenRun([5, 8, 9], 20, [3, 4], num_drafts=2)
    assert decode.is_decode
    padded = decode.with_fillers(4)
    assert list(padded.token_ids) == [5, 8, 9, 9, 9]
    assert (padded.num_drafts, padded.num_unslotted) == (2, 2)
    assert padded.is_decode
    assert padded.with_fillers(4) is padded
    assert decode.with_fillers(2) is decode
    assert not TokenRun([1, 2, 3], 0, [0]).is_decode  # a prefill chunk
    batch = flatten([TokenRun([1, 2, 3], 0, [0]), padded], 16)
    rows = LogitRows(np.array([1, 1, 0]), np.array([0, 2, 2]))
    assert rows.flat(batch.query_start).tolist() == [3, 5, 2]
