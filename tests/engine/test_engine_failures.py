"""A step that raises fails only its own requests: their blocks come back, the others finish
exactly as in a clean run, and the engine serves new requests afterwards. Requests the model
cannot honour are refused at the door."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.engine.intake import MAX_LOGPROB_ENTRIES, RequestIntake
from specbatch.errors import InvalidRequestError
from specbatch.outputs import RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    config: dict[str, Any] = {
        "model": str(model_dir),
        "num_kv_blocks": 64,
        "max_model_len": 128,
        "block_size": 8,
        "max_num_seqs": 2,
    }
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def inject_fault(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Make the third call of one stage of the step raise (after doing its work, for
    ``update_after``: the cache and queues are then already changed)."""
    owner, name = {
        "forward": (engine.runner, "execute"),
        "propose": (engine.speculator, "propose"),
        "verify": (engine.speculator, "verify"),
        "append": (engine, "_append"),
        "update": (engine.scheduler, "update_from_output"),
        "update_after": (engine.scheduler, "update_from_output"),
    }[where]
    original = getattr(owner, name)
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:  # a decode step of a and b (max_num_seqs=2: c still waits)
            if where == "update_after":
                original(*args, **kwargs)
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


@pytest.mark.engine_errors
@pytest.mark.parametrize(
    ("where", "speculative"),
    [
        ("forward", None),
        ("forward", {"method": "ngram"}),
        ("propose", {"method": "ngram"}),
        ("verify", {"method": "ngram"}),
        ("append", None),
        ("update", None),
        ("update_after", {"method": "ngram"}),
    ],
)
def test_a_failing_step_fails_only_its_requests(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, where: str, speculative: Any
) -> None:
    prompts = {"a": [5, 6, 7, 5, 6, 7], "b": [9, 10, 11], "c": [12, 13, 14, 15]}
    clean = make_engine(tiny_model_dir, speculative_config=speculative)
    for request_id, prompt in prompts.items():
        clean.add_request(request_id, prompt, GREEDY)
    expected = run(clean)

    engine = make_engine(tiny_model_dir, speculative_config=speculative)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    inject_fault(engine, monkeypatch, where)
    finals = run(engine)
    for request_id in ("a", "b"):
        failed = finals[request_id]
        assert failed.outputs[0].finish_reason == "error"
        assert failed.error is not None
        assert "injected fault" in failed.error
    assert finals["c"].error is None
    assert finals["c"].outputs[0].token_ids == expected["c"].outputs[0].token_ids
    assert engine.stats.num_failed_steps == 1
    assert engine.stats.num_requests_failed == 2
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
    engine.cache.pool.check_consistency()
    monkeypatch.undo()
    engine.add_request("again", prompts["a"], GREEDY)
    assert run(engine)["again"].outputs[0].token_ids == expected["a"].outputs[0].token_ids


def test_abort_updates_the_gauges_at_once(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.add_request("a", [5, 6, 7], GREEDY)
    assert engine.stats.num_waiting == 1
    engine.step()
    assert engine.stats.num_running == 1
    assert engine.stats.kv_cache_usage > 0
    engine.abort("a")
    assert (engine.stats.num_running, engine.stats.num_waiting) == (0, 0)
    assert engine.stats.kv_cache_usage == 0.0


HOSTILE: list[tuple[dict[str, Any], str, str]] = [
    ({"logit_bias": {300: 1.0}}, "logit_bias", "outside the vocabulary of 300"),
    ({"stop_token_ids": [300]}, "stop_token_ids", "outside the vocabulary of 300"),
]


@pytest.mark.parametrize(("fields", "param", "message"), HOSTILE)
def test_ids_outside_the_vocabulary_are_refused(
    tiny_model_dir: Path, fields: dict[str, Any], param: str, message: str
) -> None:
    engine = make_engine(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match=message) as caught:
        engine.add_request("x", [5, 6], SamplingParams(**fields))
    assert caught.value.param == param
    assert not engine.has_unfinished_requests()


def test_prompts_the_tokenizer_cannot_take_are_refused(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match="lone surrogate") as caught:
        engine.add_request("x", "a\ud800b")
    assert caught.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="characters, more than the context"):
        engine.add_request("y", "a" * (4 * engine.tokenizer.max_token_chars * 128 + 1))
    with pytest.raises(InvalidRequestError, match="token ids must be"):
        engine.add_request("z", [5, True])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match="priority"):
        engine.add_request("w", [5], priority=2**63)
    assert not engine.has_unfinished_requests()


def test_top_k_beyond_the_vocabulary_keeps_every_token(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    engine.add_request("all", [5, 6], seeded.clone(top_k=2**63 - 1))
    engine.add_request("off", [5, 6], seeded)
    finals = run(engine)
    assert finals["all"].outputs[0].token_ids == finals["off"].outputs[0].token_ids


def test_logprob_memory_is_bounded_per_request(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    intake = RequestIntake(engine.tokenizer, vocab_size=300, max_model_len=1 << 20)
    fine = SamplingParams(n=2, max_tokens=1000, logprobs=20)
    intake.check_params(fine, num_prompt_tokens=10)
    too_many = SamplingParams(n=4, max_tokens=MAX_LOGPROB_ENTRIES // 63, logprobs=20)
    with pytest.raises(InvalidRequestError, match="logprob entries") as caught:
        intake.check_params(too_many, num_prompt_tokens=10)
    assert caught.value.param == "logprobs"
    # unbounded max_tokens counts as the room left in the context
    with pytest.raises(InvalidRequestError, match="logprob entries"):
        intake.check_params(SamplingParams(n=4, max_tokens=None, logprobs=1), 10)
