"""Tensor parallelism over gloo on the CPU: 2 or 3 ranks compute what one process does (logits
within float tolerance, greedy text identical), with speculation, prefix caching, chunked
prefill and preemption; bad splits are refused; a killed worker is an error, not a hang; the
workers end with the engine."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError, TensorParallelError
from specbatch.outputs import RequestOutput
from tests.helpers import write_tiny_model

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


def make_engine(model: Path | str, tp: int, **overrides: Any) -> LLMEngine:
    config: dict[str, Any] = {
        "model": str(model),
        "num_kv_blocks": 96,
        "max_model_len": 256,
        "block_size": 8,
        "max_num_seqs": 4,
        "tensor_parallel_size": tp,
        "speculative_config": {"method": "off"},
    }
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def generate(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[RequestOutput]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    return [finals[f"r{i}"] for i in range(len(prompts))]


def compare(reference: list[RequestOutput], sharded: list[RequestOutput]) -> None:
    """Same greedy tokens; the logprobs of every prompt and generated position (the logits,
    through log-softmax) equal within float tolerance."""
    for ref, out in zip(reference, sharded, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        pairs = list(zip(ref.outputs[0].logprobs or [], out.outputs[0].logprobs or [], strict=True))
        pairs += [
            (a, b)
            for a, b in zip(ref.prompt_logprobs or [], out.prompt_logprobs or [], strict=True)
            if a is not None
        ]
        assert pairs
        for a, b in pairs:
            assert a.keys() == b.keys()
            for token in a:
                assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-4)


GREEDY = SamplingParams(
    temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5
)


@pytest.mark.parametrize(
    ("tp", "overrides"),
    [
        (2, {}),  # 4 heads, 2 KV heads: both split
        (2, {"num_key_value_heads": 1, "tie_word_embeddings": True}),  # KV replicated, tied
        (4, {}),  # 2 KV heads for 4 ranks: replicated in pairs
        (2, {"vocab_size": 299}),  # a vocabulary that does not split evenly: padded
    ],
)
def test_tensor_parallel_equals_one_process(
    tmp_path: Path, tp: int, overrides: dict[str, Any]
) -> None:
    model = write_tiny_model(tmp_path, **overrides)
    reference = generate(make_engine(model, 1), PROMPTS, GREEDY)
    engine = make_engine(model, tp)
    try:
        compare(reference, generate(engine, PROMPTS, GREEDY))
    finally:
        engine.shutdown()


def test_three_ranks_with_speculation_caching_chunks_and_preemption(
    tmp_path: Path, tiny_draft_dir: Path
) -> None:
    """Block tables come from rank 0 alone: a prefix hit, a prompt cut into chunks, a sequence
    preempted and recomputed, drafts verified and rolled back all reach every rank's cache.
    The draft model runs whole on rank 0."""
    model = write_tiny_model(
        tmp_path,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=192,
    )
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    prompts = [shared + [30, 31], shared + [40], [5, 6, 7, 5, 6, 7, 5, 6, 7], [50, 51]]
    tight = {
        "num_kv_blocks": 12,  # four sequences of ~40 tokens and 8 lookahead slots each do not fit
        "max_model_len": 64,
        "max_num_batched_tokens": 12,  # prompts in chunks
        "enable_prefix_caching": True,
    }
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    # a fixed k (every slot drafted): whether the goodput controller drafts depends on the
    # step times it measures, and this test is about what drafts do to every rank's cache
    for speculative in (
        {"method": "ngram", "num_speculative_tokens": 8, "adaptive_k": False},
        {
            "method": "draft_model",
            "model": str(tiny_draft_dir),
            "num_speculative_tokens": 8,
            "adaptive_k": False,
        },
    ):
        reference = generate(
            make_engine(model, 1, speculative_config=speculative, **tight),
            prompts,
            params,
        )
        engine = make_engine(model, 3, speculative_config=speculative, **tight)
        try:
            out = generate(engine, prompts, params)
            compare(reference, out)
            # the second prompt was admitted after the first's first block was computed: it
            # found that block of the shared prefix cached
            assert out[1].metrics.num_cached_tokens > 0, out[1].metrics
            assert engine.scheduler.num_preemptions > 0
            assert engine.stats.num_draft_tokens > 0
        finally:
            engine.shutdown()


def test_tree_steps_move_the_accepted_path_on_every_rank(tiny_model_dir: Path) -> None:
    """Draft trees whose accepted path is not the first branch: every rank moves its slice of
    the path's K/V, so the sharded text equals one process's without speculation."""
    from tests.helpers import VOCAB, SiblingOracle, prompts_with_variants

    prompts = prompts_with_variants(3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    reference = generate(make_engine(tiny_model_dir, 1), prompts, params)
    oracle = SiblingOracle(
        {f"r{i}": r.outputs[0].token_ids for i, r in enumerate(reference)}, VOCAB
    )
    config = EngineConfig(
        model=str(tiny_model_dir),
        num_kv_blocks=96,
        max_model_len=256,
        block_size=8,
        max_num_seqs=4,
        tensor_parallel_size=2,
        speculative_config={"method": "external", "num_speculative_tokens": 6},
    )
    engine = LLMEngine(config, proposer=oracle)
    try:
        compare(reference, generate(engine, prompts, params))
        assert engine.stats.num_tree_moves > 0
    finally:
        engine.shutdown()


def test_splits_that_cannot_be_made_are_refused(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "a")  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        make_engine(model, 3)
    odd_kv = write_tiny_model(
        tmp_path / "b", hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    with pytest.raises(ConfigError, match="3 key/value heads"):
        make_engine(odd_kv, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        make_engine(model, 0)
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(model=str(model), tensor_parallel_size=2, quantization="gguf")


@pytest.mark.engine_errors
def test_a_killed_worker_is_an_error_not_a_hang(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(tiny_model_dir, 2)
    assert engine._tp is not None
    (pid,) = engine._tp.pids
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.step()
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    raised: list[BaseException] = []

    def steps() -> None:
        try:
            for _ in range(100):
                engine.step()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=steps, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the engine hung after a worker died"
    assert raised
    assert isinstance(raised[0], TensorParallelError)
    assert "worker 1 exited" in str(raised[0])
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("specbatch")]
    assert any(m.endswith("end with an error, the engine is down") for m in logged), logged
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    with pytest.raises(TensorParallelError, match="engine is down"):
        engine.add_request("b", PROMPTS[1], SamplingParams())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def test_shutdown_and_garbage_collection_end_the_workers(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, 2)
    assert engine._tp is not None
    pids = engine._tp.pids
    engine.shutdown()
    assert not any(_alive(pid) for pid in pids)
    engine = make_engine(tiny_model_dir, 2)  # the process group can be made again
    assert engine._tp is not None
    pids = engine._tp.pids
    assert all(_alive(pid) for pid in pids)
    del engine
    gc.collect()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.slow
def test_the_default_model_over_three_ranks(default_gguf: Path) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads, tied embeddings) over 3 ranks, with the default
    speculation (prompt lookup and the shipped draft model): the same greedy text."""
    from specbatch.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_gguf)
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": text}])[1]
        for text in (
            "Write a haiku about the sea.",
            "Repeat this list: apples, pears, plums, apples, pears, plums.",
            "What is 12 times 12?",
        )
    ]
    common = {"num_kv_blocks": 64, "max_model_len": 512, "block_size": 16, "dtype": "float32"}
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    reference = generate(
        make_engine(default_gguf, 1, speculative_config=None, **common), prompts, params
    )
    engine = make_engine(default_gguf, 3, speculative_config=None, **common)
    try:
        out = generate(engine, prompts, params)
        for ref, got in zip(reference, out, strict=True):
            assert got.outputs[0].token_ids == ref.outputs[0].token_ids
            for a, b in zip(
                ref.outputs[0].logprobs or [], got.outputs[0].logprobs or [], strict=True
            ):
                for token in a:
                    assert b[token].logprob == pytest.approx(a[token].logprob, abs=1e-3)
        assert engine.stats.num_draft_tokens > 0
    finally:
        engine.shutdown()


@pytest.mark.engine_errors
def test_a_killed_worker_ends_an_async_engine(tiny_model_dir: Path) -> None:
    """Behind the server: the open stream ends with EngineDeadError, the engine reports itself
    errored (``/health`` answers 503) and refuses new requests; nothing hangs."""
    import asyncio

    from specbatch.engine.async_engine import AsyncEngine, EngineDeadError

    engine = make_engine(tiny_model_dir, 2)
    assert engine._tp is not None
    (pid,) = engine._tp.pids

    async def main() -> None:
        served = AsyncEngine(engine=engine)
        served.start()
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = await served.add_request(PROMPTS[0], params)
        outputs = 0
        error: BaseException | None = None
        try:
            async for _ in stream:
                outputs += 1
                if outputs == 1:
                    os.kill(pid, signal.SIGKILL)
        except EngineDeadError as exc:
            error = exc
        assert error is not None
        assert "worker 1 exited" in str(error)
        assert outputs < 200
        assert served.errored
        with pytest.raises(EngineDeadError):
            await served.add_request(PROMPTS[1], params)
        await served.shutdown(1.0)

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.engine_errors
def test_a_worker_killed_while_the_engine_is_idle_is_seen_without_a_request(
    tiny_model_dir: Path,
) -> None:
    """An idle server hears of a lost rank from its loop's idle check: it reports itself
    errored (``/health`` answers 503) within a second or two, before any request comes."""
    import asyncio

    from specbatch.engine.async_engine import AsyncEngine, EngineDeadError

    engine = make_engine(tiny_model_dir, 2)
    assert engine._tp is not None
    (pid,) = engine._tp.pids

    async def main() -> None:
        served = AsyncEngine(engine=engine)
        served.start()
        await asyncio.sleep(0.2)
        assert not served.errored
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not served.errored and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert served.errored
        assert engine.dead is not None
        assert "worker 1 exited" in engine.dead
        with pytest.raises(EngineDeadError):
            await served.add_request(PROMPTS[1], SamplingParams(max_tokens=2))
        await served.shutdown(1.0)

    asyncio.run(asyncio.wait_for(main(), 60))


class _ExitingWorker:
    """A worker caught between closing its files and becoming a zombie: its sentinel is
    ready, ``is_alive`` says alive until it has been joined (waited for)."""

    def __init__(self) -> None:
        self.sentinel, self._write = os.pipe()
        os.close(self._write)  # the child's end closed: the sentinel reads EOF
        self.joined = False
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return not self.joined

    def join(self, timeout: float | None = None) -> None:
        self.joined, self.exitcode = True, -signal.SIGKILL


def test_a_worker_seen_exiting_is_waited_for_and_named() -> None:
    """After a collective fails, a worker whose sentinel is ready is joined before the check,
    so the error names it even when its exit is not yet visible to ``is_alive``."""
    from specbatch.parallel.workers import TensorParallelError, TensorParallelGroup

    group = object.__new__(TensorParallelGroup)
    worker = _ExitingWorker()
    group.closed, group._processes, group._watch = False, [worker], None
    try:
        with pytest.raises(TensorParallelError, match=r"worker 1 exited \(exit code -9\)"):
            group.check_after_failure()
    finally:
        os.close(worker.sentinel)
