"""Speculative decoding inside the engine (tiny models): greedy identity, edge cases, metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specbatch import LLM, LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError
from tests.helpers import (
    GREEDY,
    OFF,
    OracleProposer,
    engine_kwargs,
    greedy_tokens,
    prompts_with_repeats,
)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(str(tiny_model_dir), speculative_config=OFF, **engine_kwargs())
    return greedy_tokens(plain, prompts_with_repeats(30))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "self_draft", "hybrid"])
def test_greedy_output_equals_speculation_off(
    tiny_model_dir: Path, tiny_draft_dir: Path, reference: list[list[int]], method: str, k: int
) -> None:
    config: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k}
    if method in ("draft_model", "self_draft"):
        draft = tiny_draft_dir if method == "draft_model" else tiny_model_dir
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
        if method == "self_draft":  # the chain only: a sibling of a right draft is wrong
            config["draft_tree"] = False
            config["draft_dtype"] = "float32"  # the target's own: every draft agrees
    elif method == "hybrid":
        config = {
            "method": "hybrid",
            "model": str(tiny_draft_dir),
            "num_speculative_tokens": k,
            "prompt_lookup_min": 2,
            "draft_confidence_threshold": 0.02,
        }
    llm = LLM(str(tiny_model_dir), speculative_config=config, **engine_kwargs())
    prompts = prompts_with_repeats(30)
    assert greedy_tokens(llm, prompts, batch=16) == reference
    assert greedy_tokens(llm, prompts[:6], batch=1) == reference[:6]
    stats = llm.llm_engine.stats
    assert stats.num_drafts > 0
    if method == "self_draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # a model agrees with itself


def oracle_engine(
    model_dir: Path,
    continuations: dict[str, list[int]],
    acceptance: float,
    k: int = 4,
    adaptive_k: bool = True,
    **kwargs: Any,
) -> LLMEngine:
    spec = {"method": "external", "num_speculative_tokens": k, "adaptive_k": adaptive_k}
    config = EngineConfig(
        model=str(model_dir),
        speculative_config=spec,
        **engine_kwargs(**kwargs),
    )
    return LLMEngine(config, proposer=OracleProposer(continuations, acceptance, 300, seed=3))


def run_all(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
) -> dict[str, Any]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_oracle_acceptance_extremes(
    tiny_model_dir: Path, reference: list[list[int]], acceptance: float
) -> None:
    prompts = prompts_with_repeats(30)
    truth = {f"r{i}": tokens for i, tokens in enumerate(reference)}
    engine = oracle_engine(tiny_model_dir, truth, acceptance)
    done = run_all(engine, prompts, GREEDY)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(30)] == reference
    stats = engine.stats
    if acceptance == 0.0:
        assert stats.num_accepted_tokens == 0
    if acceptance == 1.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert all(o.metrics.mean_accepted_length > 4.0 for o in done.values())
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_k_beyond_remaining_max_tokens(tiny_model_dir: Path, reference: list[list[int]]) -> None:
    truth = {f"r{i}": tokens for i, tokens in enumerate(reference)}
    engine = oracle_engine(tiny_model_dir, truth, 1.0, k=8)
    done = run_all(engine, prompts_with_repeats(30), GREEDY.clone(max_tokens=3))
    for i in range(30):
        out = done[f"r{i}"].outputs[0]
        assert out.token_ids == reference[i][:3]
        assert out.finish_reason == "length"


def test_stops_inside_accepted_drafts(tiny_model_dir: Path, reference: list[list[int]]) -> None:
    truth = {f"r{i}": tokens for i, tokens in enumerate(reference)}
    prompts = prompts_with_repeats(30)
    plain = LLM(str(tiny_model_dir), speculative_config=OFF, **engine_kwargs())
    fresh = {
        i: j for i, out in enumerate(reference) for j in range(6, 3, -1) if out[j] not in out[:j]
    }  # a token first produced at position j (3 < j <= 6)
    assert len(fresh) >= 3
    for i in sorted(fresh)[:3]:
        params = GREEDY.clone(stop_token_ids=[reference[i][fresh[i]]])
        expected = plain.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0]
        engine = oracle_engine(tiny_model_dir, {"r0": truth[f"r{i}"]}, 1.0, k=5)
        got = run_all(engine, [prompts[i]], params)["r0"].outputs[0]
        assert got.token_ids == expected.token_ids
        assert got.finish_reason == expected.finish_reason == "stop"
        stats = engine.stats
        produced = 1 + stats.num_accepted_tokens + stats.num_drafts  # prefill + verify steps
        assert produced > len(got.token_ids)  # the stop cut accepted drafts off
        text = plain.generate([prompts[i]], GREEDY, use_tqdm=False)[0].outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        expected = plain.generate([prompts[i]], GREEDY.clone(stop=[stop]), use_tqdm=False)[
            0
        ].outputs[0]
        engine = oracle_engine(tiny_model_dir, {"r0": truth[f"r{i}"]}, 1.0, k=5)
        got = run_all(engine, [prompts[i]], GREEDY.clone(stop=[stop]))["r0"].outputs[0]
        assert (got.text, got.token_ids, got.stop_reason) == (
            expected.text,
            expected.token_ids,
            expected.stop_reason,
        )


def test_eos_inside_drafts(tiny_model_dir: Path) -> None:
    eos = 2
    params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={eos: 2.0})
    plain = LLM(str(tiny_model_dir), speculative_config=OFF, **engine_kwargs())
    prompts = prompts_with_repeats(12, seed=4)
    expected = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    assert any(o.finish_reason == "stop" and len(o.token_ids) > 2 for o in expected)
    truth = {f"r{i}": o.token_ids + [7] * 20 for i, o in enumerate(expected)}
    engine = oracle_engine(tiny_model_dir, truth, 1.0, k=6)
    done = run_all(engine, prompts, params)
    for i, exp in enumerate(expected):
        got = done[f"r{i}"].outputs[0]
        assert (got.token_ids, got.finish_reason) == (exp.token_ids, exp.finish_reason)


def test_ngram_batches_mix_matches_and_misses(tiny_model_dir: Path) -> None:
    llm = LLM(
        str(tiny_model_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3},
        **engine_kwargs(),
    )
    prompts = prompts_with_repeats(12, seed=6)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    drafted = [o.metrics.num_drafts for o in outs]
    assert any(d == 0 for d in drafted)
    assert any(d > 0 for d in drafted)


def test_metrics_are_consistent(tiny_model_dir: Path, reference: list[list[int]]) -> None:
    truth = {f"r{i}": tokens for i, tokens in enumerate(reference)}
    # fixed k (the rate below is of k drafts a step; the controller's counts follow timing)
    engine = oracle_engine(tiny_model_dir, truth, 0.7, k=4, adaptive_k=False)
    done = run_all(engine, prompts_with_repeats(30), GREEDY)
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    for out in done.values():
        m = out.metrics
        assert sum(m.num_accepted_tokens_per_pos) == m.num_accepted_tokens
        assert m.num_accepted_tokens <= m.num_draft_tokens <= 4 * m.num_drafts
        assert m.num_accepted_tokens_per_pos == sorted(m.num_accepted_tokens_per_pos, reverse=True)
        assert m.mean_accepted_length == pytest.approx(1 + m.num_accepted_tokens / m.num_drafts)
        totals["drafts"] += m.num_drafts
        totals["draft_tokens"] += m.num_draft_tokens
        totals["accepted"] += m.num_accepted_tokens
    stats = engine.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        totals["drafts"],
        totals["draft_tokens"],
        totals["accepted"],
    )
    # each draft is right with probability 0.7, but only a leading run counts:
    # E[accepted] / k = (0.7 + 0.7^2 + 0.7^3 + 0.7^4) / 4 = 0.44 (fewer drafts near the end)
    assert 0.35 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.55


def test_incompatible_drafts_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.helpers import tiny_config, write_hf_checkpoint, write_tiny_tokenizer

    other = tmp_path / "other-vocab"
    write_tiny_tokenizer(other)
    write_hf_checkpoint(other, tiny_config(vocab_size=320))
    with pytest.raises(ConfigError, match="vocabulary of 320 tokens, the target 300"):
        LLM(
            str(tiny_model_dir),
            speculative_config={
                "method": "draft_model",
                "model": str(other),
                "num_speculative_tokens": 2,
            },
            **engine_kwargs(),
        )
    with pytest.raises(ConfigError, match="needs 'model'"):
        LLM(
            str(tiny_model_dir),
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2},
            **engine_kwargs(),
        )
    with pytest.raises(ConfigError, match="unknown speculative_config keys"):
        LLM(str(tiny_model_dir), speculative_config={"method": "ngram", "k": 2}, **engine_kwargs())
    with pytest.raises(
        ConfigError, match=r"num_speculative_tokens must be an integer in \[1, 16\]"
    ):
        LLM(
            str(tiny_model_dir),
            speculative_config={"method": "ngram", "num_speculative_tokens": 0},
            **engine_kwargs(),
        )


def test_each_step_reports_its_share_of_the_cores(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU the engine hands the controller each step's CPU seconds over its wall
    seconds (what tells a step slowed by another process from a dear one): with a process
    clock running at half the wall clock's rate every timed step reports a share of 0.5."""
    import time
    from types import SimpleNamespace

    from specbatch.spec_decode.control import step_times

    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
            **engine_kwargs(),
        )
    )
    controller = engine.speculator.controller
    assert controller is not None
    shares: list[float] = []
    observe = controller.observe_step

    def recording(
        tokens: int, seqs: int, pairs: float, seconds: float, share: float, decodes: bool = True
    ) -> None:
        shares.append(share)
        observe(tokens, seqs, pairs, seconds, share, decodes)

    monkeypatch.setattr(controller, "observe_step", recording)
    clock = SimpleNamespace(**vars(time))
    clock.process_time = lambda: 0.5 * time.perf_counter()
    monkeypatch.setattr(step_times, "time", clock)
    run_all(engine, prompts_with_repeats(4), GREEDY)
    assert len(shares) == engine.stats.num_steps > 0
    # (the two clocks are read a few microseconds apart: a 1 ms step reads 0.501)
    assert shares == pytest.approx([0.5] * len(shares), abs=0.025)
