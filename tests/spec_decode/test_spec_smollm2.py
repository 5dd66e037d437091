"""Speculative decoding on the real default model: greedy output equals speculation off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specbatch import LLM, SamplingParams
from tests.helpers import OFF
from tests.prompts import prompt_set

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0.0, max_tokens=24)
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "num_kv_blocks": 1200,
    "max_num_batched_tokens": 1024,
}


@pytest.fixture(scope="module")
def prompts_and_reference() -> tuple[list[str], list[list[int]]]:
    llm = LLM(**ENGINE, speculative_config=OFF)
    prompts = prompt_set(llm.get_tokenizer())
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_greedy_identity_k_1_3_5_batch_16_and_1(
    default_gguf: Path, prompts_and_reference: tuple[list[str], list[list[int]]], method: str
) -> None:
    prompts, reference = prompts_and_reference
    assert len(prompts) >= 30
    # k = 1 with prompt lookup only (suite time: the self-draft runs the target twice a step)
    for k in (1, 3, 5) if method == "ngram" else (3, 5):
        # a fixed k: under the goodput controller k is only a ceiling it may never reach
        spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k, "adaptive_k": False}
        if method == "self_draft":
            spec = {
                "method": "draft_model",
                "model": str(default_gguf),
                "num_speculative_tokens": k,
                "adaptive_k": False,
                # every chain k long (the default 0.5 would end some early)
                "draft_confidence_threshold": 0.0,
                "draft_tree": False,  # the chain only: a sibling of a right draft is wrong
                # the target's own dtype ("auto" is bfloat16 on a CPU with native bfloat16,
                # which no longer agrees with its float32 self ~100% of the time)
                "draft_dtype": "float32",
            }
        llm = LLM(speculative_config=spec, **ENGINE, max_num_seqs=16)
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        assert batched == reference, f"k={k}, batch 16"
        if k == 3:  # batch 1 once per method, on a third of the prompts (suite time): batch
            # invariance depends neither on k nor on which prompts
            one_by_one = [
                llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
                for p in prompts[:10]
            ]
            assert one_by_one == reference[:10], f"k={k}, batch 1"
        stats = llm.llm_engine.stats
        # verifies with k drafts happened (a depth's count is of verifies that reached it)
        assert len(stats.num_drafts_per_pos) == k, stats.num_drafts_per_pos
        assert stats.num_drafts_per_pos[k - 1] > 0, stats.num_drafts_per_pos
        if method == "self_draft":
            # SmolLM2 drafting for itself agrees with itself: ~100% acceptance
            assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.97


def test_greedy_identity_at_batch_64(
    prompts_and_reference: tuple[list[str], list[list[int]]],
) -> None:
    """64 sequences at once through the CPU attention kernel: speculation off and on give the
    batch-16 reference token for token (nothing about the batch changes a row's arithmetic)."""
    prompts, reference = prompts_and_reference
    many = (prompts * (64 // len(prompts) + 1))[:64]
    expected = (reference * (64 // len(reference) + 1))[:64]
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        llm = LLM(speculative_config=spec, **{**ENGINE, "num_kv_blocks": 2400}, max_num_seqs=64)
        assert llm.llm_engine.model.backend.name == "cpu"
        outputs = [o.outputs[0].token_ids for o in llm.generate(many, PARAMS, use_tqdm=False)]
        assert outputs == expected, spec
        del llm
