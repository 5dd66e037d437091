"""The contract: speculative sampling is distributed exactly as the target sampling alone.

Tiny random target and draft (vocabulary 32); 12,000 requests of 3 tokens each through the
engine, compared by chi-square with the exact distribution of the first three tokens computed
from the target model with the same sampling processing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.spec_decode.distribution import (
    LOOKUP_PROMPT,
    PARAMS,
    PROMPT,
    assert_matches,
    exact_distribution,
    sample_engine,
)

CASES = [
    ("ngram", "plain"),
    ("ngram", "top-k-top-p"),
    ("ngram", "penalties"),
    ("draft_model", "plain"),
    ("draft_model", "top-k-top-p"),
    ("draft_model", "penalties"),
    ("hybrid", "plain"),
    ("hybrid", "top-k-top-p"),
]


@pytest.mark.parametrize(("method", "params_name"), CASES)
def test_speculative_sampling_matches_target(
    models: tuple[Path, Path], method: str, params_name: str
) -> None:
    target, draft = models
    params = PARAMS[params_name]
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 2}
    if method != "ngram":
        spec["model"] = str(draft)
    prompt = PROMPT
    if method == "hybrid":
        # 2-token lookups hit for some histories only: point masses and q rows in one verify;
        # 5 tokens so that the first three are decided with up to 2 drafts, the draft stopping
        # early at some rows; the way for sequences without a 2-token match (the draft model
        # or a 1-token match) chosen at random rather than learnt, so that both are verified
        spec.update(prompt_lookup_min=2, draft_confidence_threshold=0.1)
        prompt = LOOKUP_PROMPT
        params = params.clone(max_tokens=5)
    joint12, marginal3 = exact_distribution(target, params, prompt)
    assert_matches(sample_engine(target, spec, params, prompt=prompt), joint12, marginal3)


def test_seeded_speculative_sampling_matches_target(models: tuple[Path, Path]) -> None:
    target, draft = models
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    joint12, marginal3 = exact_distribution(target, PARAMS["plain"])
    assert_matches(sample_engine(target, spec, PARAMS["plain"], seeded=True), joint12, marginal3)


def test_plain_sampling_matches_target(models: tuple[Path, Path]) -> None:
    target, _ = models
    joint12, marginal3 = exact_distribution(target, PARAMS["penalties"])
    assert_matches(sample_engine(target, None, PARAMS["penalties"]), joint12, marginal3)


def test_a_gguf_target_with_a_q8_0_draft_samples_the_targets_distribution(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """The target's Q4_1/Q8_0 blocks multiplied as stored, the draft model's weights made Q8_0
    blocks (what ``draft_dtype="auto"`` gives under such a target): distributed as that
    target alone."""
    import json

    import gguf
    from safetensors.torch import load_file

    from tests.gguf_writer import write_gguf

    target, draft = models
    config = json.loads((target / "config.json").read_text())
    state = load_file(str(target / "model.safetensors"))
    qtypes = {
        name: gguf.GGMLQuantizationType.Q8_0
        if "embed" in name or "lm_head" in name
        else gguf.GGMLQuantizationType.Q4_1
        for name, tensor in state.items()
        if tensor.dim() == 2
    }
    write_gguf(tmp_path / "target.gguf", config, state, qtypes=qtypes)
    spec = {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 2,
        "draft_dtype": "q8_0",
    }
    joint12, marginal3 = exact_distribution(
        tmp_path / "target.gguf", PARAMS["plain"], quantization="gguf"
    )
    sampled = sample_engine(
        tmp_path / "target.gguf",
        spec,
        PARAMS["plain"],
        tokenizer=str(target),
        quantization="gguf",
    )
    assert_matches(sampled, joint12, marginal3)
