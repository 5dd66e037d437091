"""Speculation on each family beside Llama: greedy and seeded text with the default
speculation (and with prompt lookup at a fixed k, so that drafts are surely verified, accepted
and rolled back) equal to speculation off, alone and in a batch of 6, with preemption and
prefix-cache hits; prompts past the sliding window, so that rollbacks cross the window's edge.
And the chi-square contract at T > 0 on a sliding-window family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specbatch import LLM, SamplingParams
from tests.gguf_families import FAMILIES, WINDOW, write_family_dir
from tests.helpers import OFF
from tests.spec_decode.distribution import (
    PARAMS,
    V,
    assert_matches,
    exact_distribution,
    sample_engine,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True)
FIXED = {"method": "ngram", "num_speculative_tokens": 4, "adaptive_k": False}
# repeated spans, for prompt lookup to hit, each longer than the window (12)
PROMPTS = [[5 + i, 9, 17, 33, 41, 9, 17, 33, 41, 9, 17, 60 + i] * (2 + i % 3) for i in range(6)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    write_family_dir(directory, request.param)
    return directory


def texts(llm: LLM, params: SamplingParams, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("speculation", [None, FIXED], ids=["default", "ngram-k4"])
def test_speculation_gives_the_texts_of_speculation_off(
    family_dir: Path, speculation: dict[str, Any] | None
) -> None:
    # a cache of 24 blocks of 8 for 6 sequences of up to ~70 tokens: some are preempted
    common = {"model": str(family_dir), "max_model_len": 256, "block_size": 8}
    off = LLM(speculative_config=OFF, num_kv_blocks=200, **common)
    expected = [texts(off, p, PROMPTS) for p in (GREEDY, SEEDED)]
    del off
    spec = LLM(speculative_config=speculation, num_kv_blocks=40, **common)
    for params, want in zip((GREEDY, SEEDED), expected, strict=True):
        outputs = spec.generate(PROMPTS, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want
        again = spec.generate(PROMPTS[-1:], params, use_tqdm=False)  # alone, a prefix hit
        assert list(again[0].outputs[0].token_ids) == want[-1]
        assert again[0].metrics.num_cached_tokens > 0
    if speculation is FIXED:
        stats = spec.llm_engine.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rolled back
        assert sum(o.metrics.num_preemptions for o in outputs) > 0


def test_sliding_window_sampling_keeps_the_target_distribution(tmp_path: Path) -> None:
    """Gemma 3 with a window of 12 over a 35-token prompt: prompt lookup at fixed k, sampled
    12,000 times, against the exact distribution of its first three tokens."""
    target = tmp_path / "gemma3"
    write_family_dir(target, "gemma3", seed=3, vocab_size=V)
    prompt = [t % (V - 3) + 3 for t in range(5, 40)]
    assert len(prompt) > WINDOW
    joint12, marginal3 = exact_distribution(target, PARAMS["plain"], prompt)
    sampled = sample_engine(target, {"method": "ngram", "num_speculative_tokens": 2},
                            PARAMS["plain"], prompt=prompt)  # fmt: skip
    assert_matches(sampled, joint12, marginal3)
