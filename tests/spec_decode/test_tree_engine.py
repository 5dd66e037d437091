"""Draft trees inside the engine (tiny models): outputs equal speculation off, the accepted
path's K/V end up at the sequence's positions, logprobs, blocks under abort and preemption."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch import LLM, LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.sequence import Sequence as EngineSequence
from specbatch.spec_decode.proposers.base import DraftRequest, Proposal
from specbatch.spec_decode.proposers.draft_trees import with_siblings
from tests.helpers import (
    GREEDY,
    OFF,
    VOCAB,
    SiblingOracle,
    check_blocks,
    engine_kwargs,
    force_draft_chains,
    greedy_tokens,
    network_proposer,
    prompts_with_variants,
    run_engine,
)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_with_variants(16)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs())
    return greedy_tokens(llm, prompts)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("method", ["ngram", "hybrid"])
def test_lookup_trees_give_the_output_of_speculation_off(
    tiny_model_dir: Path,
    tiny_draft_dir: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    method: str,
    adaptive: bool,
) -> None:
    spec: dict[str, Any] = {"method": method, "lookup_tree": True, "adaptive_k": adaptive}
    if method == "hybrid":
        spec["model"] = str(tiny_draft_dir)
    if not adaptive:
        spec["num_speculative_tokens"] = 5
    llm = LLM(str(tiny_model_dir), speculative_config=spec, **engine_kwargs())
    if adaptive:  # the controller drafts where rows are cheap: seen so whatever this machine's
        # load (measured, a tiny model's rows can cost most of its step, and then no tree runs)
        controller = llm.llm_engine.speculator.controller
        assert controller is not None
        observe = controller.observe_step

        def cheap_rows(
            tokens: int,
            seqs: int,
            pairs: float,
            seconds: float,
            share: float = 1.0,
            decodes: bool = True,
        ) -> None:
            observe(tokens, seqs, pairs, 0.01 + 1e-5 * tokens, share, decodes)

        controller.observe_step = cheap_rows  # type: ignore[method-assign]
    assert greedy_tokens(llm, prompts, batch=2 if adaptive else 16) == reference
    stats = llm.llm_engine.stats
    assert stats.num_tree_drafts > 0, stats  # trees did run
    # ... and some path was not the first branch (the controller's choices follow measured
    # times: how many trees it verifies varies from run to run)
    assert adaptive or stats.num_tree_moves > 0, stats


@pytest.mark.parametrize("batch", [1, 16])
def test_tree_steps_with_chunked_prefill_and_preemption(
    tiny_model_dir: Path, prompts: list[list[int]], reference: list[list[int]], batch: int
) -> None:
    """Few blocks (preemption) and a small token budget (prompts in chunks beside trees)."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            num_kv_blocks=30,
            block_size=4,
            max_model_len=80,
            max_num_batched_tokens=24,
            max_num_seqs=8,
            speculative_config={"method": "external", "num_speculative_tokens": 6},
        ),
        proposer=SiblingOracle({str(i): r for i, r in enumerate(reference)}, VOCAB),
    )
    out = run_engine(engine, prompts, GREEDY, batch)
    assert out == reference
    assert engine.stats.num_tree_moves > 0
    assert batch == 1 or engine.scheduler.num_preemptions > 0
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def oracle_engine(model_dir: Path, reference: list[list[int]], **overrides: Any) -> LLMEngine:
    config: dict[str, Any] = {
        "model": str(model_dir),
        "speculative_config": {"method": "external", "num_speculative_tokens": 6},
        **engine_kwargs(),
        **overrides,
    }
    oracle = SiblingOracle({str(i): r for i, r in enumerate(reference)}, VOCAB)
    return LLMEngine(EngineConfig(**config), proposer=oracle)


def test_seeded_sampling_does_not_depend_on_the_tree(
    tiny_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=32, seed=7, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs())
    plain = greedy_tokens(llm, prompts, params)
    del llm
    # the oracle's trees around the greedy text, every step (fixed k: at batch 16 a row of
    # the tiny model costs what a token does, and the controller rightly drafts little for
    # samples that seldom agree with the greedy text): seeded samples partly agree with them
    fixed = {"method": "external", "num_speculative_tokens": 6, "adaptive_k": False}
    engine = oracle_engine(tiny_model_dir, reference, speculative_config=fixed)
    assert run_engine(engine, prompts, params, 16) == plain
    assert engine.stats.num_accepted_tokens > 0
    assert engine.stats.num_tree_moves > 0
    spec = {"method": "ngram", "lookup_tree": True, "adaptive_k": False}
    llm = LLM(str(tiny_model_dir), speculative_config=spec, **engine_kwargs())
    assert greedy_tokens(llm, prompts, params) == plain


def test_the_accepted_paths_kv_is_at_the_sequences_positions(
    tiny_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """After tree steps the cache holds what a plain prefill of the same text computes, at
    every position (the accepted nodes moved, the rest rolled back)."""
    engine = oracle_engine(tiny_model_dir, reference)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), prompt_token_ids=prompts[i], params=params)
    for _ in range(6):
        engine.step()
    assert engine.stats.num_tree_moves > 0
    plain = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), speculative_config=OFF, **engine_kwargs())
    )
    for seq in engine.scheduler.running:
        text = seq.token_ids[: seq.num_computed_tokens]
        plain.add_request(
            seq.request_id, prompt_token_ids=text, params=SamplingParams(max_tokens=2)
        )
        plain.step()  # the prompt's prefill: its K/V stay in the cache until the request ends
        (computed,) = plain.scheduler.running
        assert computed.num_computed_tokens == len(text)
        for (k, v), (k_ref, v_ref) in zip(
            engine.model.kv_caches(), plain.model.kv_caches(), strict=True
        ):
            for cache, cache_ref in ((k, k_ref), (v, v_ref)):
                torch.testing.assert_close(
                    gather(cache, seq.block_table, len(text)),
                    gather(cache_ref, computed.block_table, len(text)),
                    rtol=1e-4,
                    atol=1e-5,
                )
        plain.abort(seq.request_id)


def gather(cache: torch.Tensor, block_table: list[int], count: int) -> torch.Tensor:
    """The first ``count`` positions' entries of a paged cache ``[blocks, block_size, ...]``."""
    block_size = cache.shape[1]
    rows = [cache[block_table[p // block_size], p % block_size] for p in range(count)]
    return torch.stack(rows)


def test_logprobs_come_from_the_accepted_paths_rows(
    tiny_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3)
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs())
    plain = llm.generate(prompts[:6], params, use_tqdm=False)
    engine = oracle_engine(tiny_model_dir, reference)
    for i, prompt in enumerate(prompts[:6]):
        engine.add_request(str(i), prompt_token_ids=prompt, params=params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0]
    assert engine.stats.num_tree_moves > 0
    for i, expected in enumerate(plain):
        got = done[i]
        assert got.token_ids == expected.outputs[0].token_ids
        assert got.logprobs is not None
        assert expected.outputs[0].logprobs is not None
        for mine, theirs in zip(got.logprobs, expected.outputs[0].logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            for token in mine:
                assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)


def test_abort_in_the_middle_of_tree_steps_frees_every_block(
    tiny_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    engine = oracle_engine(
        tiny_model_dir,
        reference,
        num_kv_blocks=40,
        block_size=4,
        max_model_len=80,
        enable_prefix_caching=True,
    )
    rng = random.Random(0)
    live: list[str] = []
    for step in range(60):
        if len(live) < 6:
            i = rng.randrange(len(prompts))
            request_id = f"{i}"
            if request_id not in live and request_id not in engine.requests:
                engine.add_request(request_id, prompt_token_ids=prompts[i], params=GREEDY)
                live.append(request_id)
        if live and rng.random() < 0.2:
            engine.abort(live.pop(rng.randrange(len(live))))
        for o in engine.step():
            assert o.error is None
            if o.finished and o.request_id in live:
                live.remove(o.request_id)
                assert (
                    o.outputs[0].token_ids
                    == reference[int(o.request_id)][: len(o.outputs[0].token_ids)]
                )
        check_blocks(engine)
        if step == 30:
            assert engine.stats.num_tree_moves > 0
    for request_id in live:
        engine.abort(request_id)
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
    check_blocks(engine)


def test_a_cached_prefix_after_tree_steps_gives_the_same_text(
    tiny_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Blocks filled by tree steps enter the prefix index only with their final K/V: a request
    that reuses them (the prompt plus the generated text) continues as plain decoding does."""
    engine = oracle_engine(tiny_model_dir, reference, enable_prefix_caching=True, block_size=4)
    continuations = engine.proposer.continuations  # type: ignore[union-attr]
    plain = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs())
    for i in range(3):
        text = prompts[i] + reference[i]
        expected = plain.generate([text], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        continuations[f"a{i}"] = reference[i]
        engine.add_request(f"a{i}", prompt_token_ids=prompts[i], params=GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        continuations[f"b{i}"] = expected
        engine.add_request(f"b{i}", prompt_token_ids=text, params=GREEDY)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        assert outputs[0].outputs[0].token_ids == expected
    assert engine.stats.num_tree_moves > 0


def sibling_engine(
    model: Path, draft: Path, threshold: float = 0.5, kind: str = "siblings"
) -> LLMEngine:
    spec = {
        "method": "draft_model",
        "model": str(draft),
        "draft_tree": True,
        "draft_tree_kind": kind,
        "draft_confidence_threshold": threshold,
        "draft_dtype": "float32",  # its cache is compared with a float32 engine's
    }
    return LLMEngine(EngineConfig(model=str(model), speculative_config=spec, **engine_kwargs()))


@pytest.mark.parametrize(
    ("batch", "forced", "dynamic"),
    [(1, True, False), (8, True, False), (8, False, False), (1, True, True), (8, True, True)],
)
def test_draft_siblings_give_the_output_of_speculation_off(
    tiny_model_dir: Path,
    noisy_draft_dir: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    batch: int,
    forced: bool,
    dynamic: bool,
) -> None:
    """Siblings of the chain, or (``dynamic``) the draft model's EAGLE-2 dynamic trees."""
    engine = sibling_engine(
        tiny_model_dir, noisy_draft_dir, kind="dynamic" if dynamic else "siblings"
    )
    assert network_proposer(engine).dynamic_trees == dynamic
    if forced:
        force_draft_chains(engine, 2)
    assert run_engine(engine, prompts, GREEDY, batch) == reference
    stats = engine.stats
    # speculation ran: drafts were verified and some emitted (unforced, the controller drafts
    # every slot until it has measured a few steps, whatever this machine's times)
    assert stats.num_draft_tokens > 0, stats
    assert stats.num_accepted_tokens > 0, stats
    if forced:  # a row is priced below one token: trees were verified, siblings accepted
        assert stats.num_tree_drafts > 0, stats
        assert stats.num_tree_moves > 0, stats


def test_a_fixed_draft_tree_gives_the_output_of_speculation_off(
    tiny_model_dir: Path,
    noisy_draft_dir: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    """No controller: every sequence gets 5 nodes, its chain at most 2 deep, siblings in the
    rest (price 0: every candidate with a chance)."""
    spec = {
        "method": "draft_model",
        "model": str(noisy_draft_dir),
        "num_speculative_tokens": 5,
        "adaptive_k": False,
        "draft_tree": True,
        "draft_tree_depth": 2,
        "draft_confidence_threshold": 0.0,
    }
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), speculative_config=spec, **engine_kwargs())
    )
    assert run_engine(engine, prompts, GREEDY, 4) == reference
    stats = engine.stats
    assert stats.num_tree_moves > 0, stats
    assert len(stats.num_drafts_per_pos) == 2, stats
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_seeded_sampling_with_draft_siblings_equals_speculation_off(
    tiny_model_dir: Path, noisy_draft_dir: Path, prompts: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.8, max_tokens=32, seed=3, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs())
    plain = greedy_tokens(llm, prompts, params)
    engine = sibling_engine(tiny_model_dir, noisy_draft_dir)
    force_draft_chains(engine, 2)
    assert run_engine(engine, prompts, params, 4) == plain
    assert engine.stats.num_tree_moves > 0, engine.stats


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_draft_cache_holds_what_it_claims_after_sibling_steps(
    tiny_model_dir: Path,
    noisy_draft_dir: Path,
    prompts: list[list[int]],
    dynamic: bool,
) -> None:
    """Where the target took a sibling, the draft's cache (which holds the chain) is valid
    only before it: every position the draft claims equals a plain prefill of the text. With
    ``dynamic`` trees (nodes written at their tree slots) it ends at the first draft."""
    kind = "dynamic" if dynamic else "siblings"
    engine = sibling_engine(tiny_model_dir, noisy_draft_dir, threshold=0.0, kind=kind)
    force_draft_chains(engine, 3)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("0", prompt_token_ids=prompts[0], params=params)
    drafter = network_proposer(engine)
    sibling_accepted = 0
    verified = drafter.on_verified

    def watch(seq: Any) -> None:  # did the path leave the chain before its last draft?
        nonlocal sibling_accepted
        plain_rule = min(drafter._computed.get(seq.seq_id, 0), seq.num_computed_tokens)
        verified(seq)
        sibling_accepted += drafter._computed.get(seq.seq_id, 0) < plain_rule

    drafter.on_verified = watch  # type: ignore[method-assign]

    def taken() -> int:  # dynamic trees: accepted paths off the first-child line
        return engine.stats.num_tree_moves if dynamic else sibling_accepted

    for _ in range(150):
        if taken() >= 3:
            break
        for out in engine.step():
            assert out.error is None
    assert taken() >= 3
    (seq,) = engine.scheduler.running
    held = drafter._computed[seq.seq_id]
    plain = LLMEngine(
        EngineConfig(model=str(noisy_draft_dir), speculative_config=OFF, **engine_kwargs())
    )
    plain.add_request(
        "x", prompt_token_ids=seq.token_ids[:held], params=SamplingParams(max_tokens=2)
    )
    plain.step()
    (computed,) = plain.scheduler.running
    for (k, v), (k_ref, v_ref) in zip(
        drafter.net.model.kv_caches(), plain.model.kv_caches(), strict=True
    ):
        for cache, cache_ref in ((k, k_ref), (v, v_ref)):
            torch.testing.assert_close(
                gather(cache, seq.block_table, held),
                gather(cache_ref, computed.block_table, held),
                rtol=1e-4,
                atol=1e-5,
            )


def test_siblings_are_added_best_first_within_price_and_slots() -> None:
    seq = EngineSequence(0, "r", 0, [1, 2, 3], SamplingParams(temperature=0.0), 0.0)
    chain = [10, 11]
    candidates = [(0.30, 0, 20), (0.05, 0, 21), (0.20, 1, 22), (0.25, 1, 23)]
    request = DraftRequest(seq, 2, max_nodes=4, node_price=0.1)
    parents = with_siblings(chain, [], candidates, request)
    assert chain == [10, 11, 20, 23]  # the two best of those above 0.1: two slots left
    assert parents == [-1, 0, -1, 0]  # 20 beside draft 0 (under the root), 23 beside draft 1
    assert with_siblings([10], [], [(0.05, 0, 21)], request) is None  # none pays


def test_per_request_metrics_count_tree_nodes_and_depths(
    tiny_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """A tree's nodes are its draft tokens; acceptance by position goes by depth (the oracle's
    trees hold two nodes per level: at most 3 levels in 6 slots)."""
    engine = oracle_engine(tiny_model_dir, reference)
    for i, prompt in enumerate(prompts[:8]):
        engine.add_request(str(i), prompt_token_ids=prompt, params=GREEDY)
    metrics = []
    while engine.has_unfinished_requests():
        metrics += [o.metrics for o in engine.step() if o.finished]
    assert engine.stats.num_tree_moves > 0
    for m in metrics:
        assert m is not None
        assert len(m.num_accepted_tokens_per_pos) <= 3
        assert sum(m.num_accepted_tokens_per_pos) == m.num_accepted_tokens
        assert m.num_accepted_tokens <= m.num_draft_tokens <= 6 * m.num_drafts
        assert m.num_accepted_tokens_per_pos == sorted(m.num_accepted_tokens_per_pos, reverse=True)


@pytest.mark.parametrize("seeded", [False, True])
def test_priced_first_drafts_give_the_output_of_speculation_off(
    tiny_model_dir: Path,
    noisy_draft_dir: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    seeded: bool,
) -> None:
    """A verify row priced at 0.02 tokens (this draft's likeliest tokens have 0.01-0.03): a
    first draft the draft gives less is dropped after its forward (that sequence gets no
    drafts, siblings neither), the others are verified. Greedy and seeded outputs stay
    speculation off's."""
    params = GREEDY.clone(temperature=0.8, seed=11) if seeded else GREEDY
    if seeded:
        off = LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs()
            )
        )
        reference = run_engine(off, prompts, params, 8)
    engine = sibling_engine(tiny_model_dir, noisy_draft_dir, threshold=0.0)
    force_draft_chains(engine, 2, row_seconds=0.0002)
    drafter = network_proposer(engine)
    assert drafter is not None
    given: list[tuple[float, int]] = []
    propose = drafter.propose

    def counting(requests: list[DraftRequest]) -> Proposal:
        proposal = propose(requests)
        given.extend((r.row_price, len(t)) for r, t in zip(requests, proposal.tokens, strict=True))
        return proposal

    drafter.propose = counting  # type: ignore[method-assign]
    assert run_engine(engine, prompts, params, 8) == reference
    assert all(price == pytest.approx(0.02) for price, _ in given)
    dropped = sum(1 for _, n in given if n == 0)
    # some first drafts were not worth their row, some were
    assert 0 < dropped < len(given), (dropped, len(given))
    # the kept ones, and only those, reached the verifier whole (a dropped one has no row)
    stats = engine.stats
    assert stats.num_drafts == len(given) - dropped, stats
    assert stats.num_draft_tokens == sum(n for _, n in given), stats
