"""The shipped draft for the default target: intact, compatible, lossless and still accepting."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.errors import ConfigError, ModelLoadError
from specbatch.models import load_model
from specbatch.spec_decode.proposers import shipped as default_draft
from tests.helpers import OFF
from tests.prompts import CHAT, PLAIN

pytestmark = pytest.mark.slow

# Greedy per-draft-token acceptance (k = 4) measured on these prompts when the draft was
# committed: 0.129. The guard leaves a margin for float noise and small engine changes, and fails
# if a change to the draft, the tokenizer or the proposer breaks the draft's alignment with the
# target.
MIN_ACCEPTANCE = 0.10
ENGINE = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 600, "max_num_seqs": 16}
PARAMS = SamplingParams(temperature=0.0, max_tokens=32)


def test_shipped_draft_matches_its_checksum_and_the_target_vocabulary() -> None:
    path = default_draft.default_draft_path()
    weights = path / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == default_draft.DRAFT_SHA256
    assert weights.stat().st_size <= 25 * 2**20
    draft = load_model(path)
    assert draft.config.output_vocab_size == 49152  # SmolLM2's vocabulary, ids shared
    token_map = draft.config.token_map
    assert token_map is not None
    assert len(set(token_map)) == len(token_map)
    assert max(token_map) < 49152


@pytest.mark.parametrize("rows", [0, 1, 8])
def test_draft_logits_land_on_their_target_ids(rows: int) -> None:
    """Each draft row's logit at its target id (the token map), -inf at every other id,
    checked against a loop over the map; the padded rows past the map are dropped."""
    draft = load_model(default_draft.default_draft_path())
    token_map = draft.config.token_map
    assert token_map is not None
    logits = torch.randn(rows, draft.config.vocab_size, generator=torch.Generator().manual_seed(3))
    out = draft.logits_in_output_vocab(logits)
    expected = torch.full((rows, 49152), float("-inf"))
    for row in range(rows):
        for draft_id, target_id in enumerate(token_map):
            expected[row, target_id] = logits[row, draft_id]
    assert torch.equal(out, expected)


def test_damaged_or_missing_draft_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_draft, "DRAFT_SHA256", "0" * 64)
    with pytest.raises(ModelLoadError, match="does not match the shipped draft"):
        default_draft.default_draft_path()
    monkeypatch.setattr(default_draft, "DRAFT_SHA256", "")
    with pytest.raises(ConfigError, match="ships no draft"):
        default_draft.default_draft_path()


def test_draft_for_another_target_is_a_clear_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="ships only for SmolLM2-135M-Instruct"):
        LLM(
            model=str(tiny_model_dir),
            speculative_config={"method": "draft_model", "num_speculative_tokens": 3},
        )


def test_the_target_is_recognised_by_content(tiny_model_dir: Path, default_gguf: Path) -> None:
    from specbatch.models import load_config
    from specbatch.tokenizer import load_tokenizer

    config, tokenizer = load_config(default_gguf), load_tokenizer(default_gguf)
    assert default_draft.drafts_for(config, tokenizer)
    assert not default_draft.drafts_for(config.replace(num_hidden_layers=29), tokenizer)
    tiny = load_tokenizer(tiny_model_dir)
    assert not default_draft.drafts_for(config, tiny)


def test_shipped_draft_is_lossless_and_keeps_its_acceptance(default_gguf: Path) -> None:
    # always k drafts: the acceptance guard measures the draft, not the confidence stop
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "draft_confidence_threshold": 0}
    # the default model given by its path (not its name) gets the shipped draft too
    llm = LLM(str(default_gguf), speculative_config=spec, **ENGINE)
    tokenizer = llm.get_tokenizer()
    prompts = PLAIN[:8] + [
        tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT[:8]
    ]
    speculative = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    stats = llm.llm_engine.stats
    acceptance = stats.num_accepted_tokens / stats.num_draft_tokens
    del llm
    plain = LLM(**ENGINE, speculative_config=OFF)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]
    assert speculative == reference
    assert acceptance >= MIN_ACCEPTANCE, f"greedy acceptance {acceptance:.3f}"
