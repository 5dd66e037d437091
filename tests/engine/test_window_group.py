"""An engine over a model with sliding-window layers (a tiny Gemma 3, window 12) keeps those
layers' K/V for their window only: the same text as an engine whose every layer keeps every
position, greedy and seeded, with speculation (prompt lookup, drafts rolled back), chunked
prefill, preemption and prefix-cache hits; its sliding layers' pool holds no sequence's blocks
past its window, and every block of both pools comes back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specbatch import LLM, SamplingParams
from specbatch.cache.window_cache import HybridKVCache
from specbatch.engine import setup
from specbatch.utils import ceil_div
from tests.gguf_families import WINDOW, write_family_dir
from tests.helpers import per_op_layers

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_k": False}
PROMPTS = [[5 + i, 9, 17, 33, 41, 9, 17, 33, 41, 60 + i] * (3 + i % 4) for i in range(6)]
COMMON: dict[str, Any] = {
    "max_model_len": 256,
    "block_size": 8,
    "max_num_batched_tokens": 24,  # prompts of 30-60 tokens: chunked prefill
    "speculative_config": SPEC,
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gemma3")
    write_family_dir(directory, "gemma3", seed=4)
    return directory


def texts(llm: LLM, params: SamplingParams, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_windowed_layers_keep_only_their_window_and_the_text(
    gemma: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patch:  # every layer in the one pool, every position kept
        patch.setattr(setup, "window_group_blocks", lambda *args: None)
        whole = LLM(str(gemma), num_kv_blocks=200, **COMMON)
        assert not isinstance(whole.llm_engine.cache, HybridKVCache)
        expected = [texts(whole, p, PROMPTS) for p in (GREEDY, SEEDED)]
        del whole
    llm = LLM(str(gemma), num_kv_blocks=36, **COMMON)  # tight: some are preempted
    engine = llm.llm_engine
    cache = engine.cache
    assert isinstance(cache, HybridKVCache)
    window_pool = cache.window.num_blocks
    seen: list[int] = []
    step = engine.step

    def watched() -> Any:  # the window group's holdings after every step
        out = step()
        for seq in engine.scheduler.running:
            seen.append(len(seq.window_table) - cache.window.unheld(seq))
        return out

    engine.step = watched  # type: ignore[method-assign]
    for params, want in zip((GREEDY, SEEDED), expected, strict=True):
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want
        again = llm.generate(PROMPTS[-2:], params, use_tqdm=False)  # the freshest: hits
        assert [list(o.outputs[0].token_ids) for o in again] == want[-2:]
        assert sum(o.metrics.num_cached_tokens for o in again) > 0
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert engine.stats.num_accepted_tokens > 0
    assert engine.model.fused.applies()  # the fused layer read the window group's tables;
    with per_op_layers(engine.model):  # the per-op layers pick their group's metadata
        assert texts(llm, GREEDY, PROMPTS) == expected[0]
    # a sequence holds its window, a step's chunk and its drafts: never its whole length
    bound = ceil_div(WINDOW - 1 + COMMON["max_num_batched_tokens"] + 3, 8) + 1
    assert seen
    assert max(seen) <= bound < ceil_div(max(len(p) for p in PROMPTS) + 40, 8)
    assert cache.full.num_free_blocks == cache.full.num_blocks
    assert cache.window.num_free_blocks == window_pool
    cache.full.pool.check_consistency()
    cache.window.pool.check_consistency()
