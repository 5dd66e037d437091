"""Rollback under random acceptance, aborts and preemption: no block leaks, and no rejected
draft's K/V is ever attended (every verify row equals a fresh recompute of its prefix)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specbatch import LLM, LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.models import load_model
from specbatch.spec_decode.proposers.base import Proposal
from specbatch.spec_decode.verification.chain import VerifyResult
from tests.helpers import OFF, OracleProposer, PagedHarness

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path) -> dict[str, Any]:
    prompts = [list(range(3 + i, 13 + 2 * i)) for i in range(8)]
    plain = LLM(
        str(tiny_model_dir),
        speculative_config=OFF,
        num_kv_blocks=128,
        max_model_len=128,
        block_size=4,
    )
    truth = [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]
    return {"prompts": prompts, "truth": truth, "fresh": load_model(tiny_model_dir)}


def checked_engine(
    model_dir: Path, truth: dict[str, list[int]], acceptance: float, fresh: Any, k: int
) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            num_kv_blocks=24,
            block_size=4,
            max_model_len=64,
            max_num_batched_tokens=40,
            speculative_config={"method": "external", "num_speculative_tokens": k},
        ),
        proposer=OracleProposer(truth, acceptance, 300, seed=int(acceptance * 100) + k),
    )
    verify = engine.speculator.verify

    def recomputing_verify(logits: torch.Tensor, seqs: list, proposal: Proposal) -> VerifyResult:
        row = 0
        for seq, drafts in zip(seqs, proposal.tokens, strict=True):
            tokens = seq.token_ids + drafts
            expected = PagedHarness(fresh, num_blocks=32, block_size=4).forward([(0, tokens)])[0]
            rows = len(drafts) + 1
            torch.testing.assert_close(
                logits[row : row + rows], expected[-rows:], rtol=0, atol=1e-4
            )
            row += rows
        return verify(logits, seqs, proposal)

    engine.speculator.verify = recomputing_verify  # type: ignore[method-assign]
    return engine


def assert_pool_whole(engine: LLMEngine) -> None:
    pool = engine.cache.pool
    pool.check_consistency()
    holders: Counter[int] = Counter()
    for seq in engine.scheduler.running:
        holders.update(seq.block_table)
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == holders[block]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    acceptance=st.floats(0.0, 1.0),
    k=st.integers(1, 6),
    aborts=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 7)), max_size=4),
)
def test_random_acceptance_aborts_and_preemption(
    tiny_model_dir: Path,
    setup: dict[str, Any],
    acceptance: float,
    k: int,
    aborts: list[tuple[int, int]],
) -> None:
    truth = {f"r{i}": t for i, t in enumerate(setup["truth"])}
    engine = checked_engine(tiny_model_dir, truth, acceptance, setup["fresh"], k)
    for i, prompt in enumerate(setup["prompts"]):
        engine.add_request(f"r{i}", prompt, PARAMS)
    aborted = set()
    finished: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for at_step, index in aborts:
            if at_step == step and engine.abort(f"r{index}"):
                aborted.add(f"r{index}")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        assert_pool_whole(engine)
        step += 1
    for request_id, tokens in finished.items():
        assert tokens == truth[request_id], request_id
    assert set(finished) | aborted == set(truth)
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
