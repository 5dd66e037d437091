"""The shipped draft head for the default target: intact, made for it, lossless with chains and
trees at batch 1 and 16 on 30 prompts, and still accepting."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from specbatch import LLM, LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError, ModelLoadError
from specbatch.spec_decode.proposers import shipped as default_draft
from specbatch.spec_decode.proposers.head import HeadNetwork, load_head
from tests.helpers import force_draft_chains, network_proposer, run_engine
from tests.prompts import CHAT, PLAIN

pytestmark = pytest.mark.slow

# Greedy first-draft acceptance (k = 4, no confidence stop) measured on these 30 prompts when the
# head was committed: 0.319. The guard leaves a margin for float noise and engine changes and
# fails when a change to the head, the features handed to it or the proposer breaks its
# alignment with the target (features one position late: 0.230, checked).
MIN_FIRST_ACCEPTANCE = 0.25
ENGINE = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 900, "max_num_seqs": 16}
PARAMS = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = LLM(**ENGINE, speculative_config={"method": "off"}).get_tokenizer()
    chats = [tokenizer.encode_chat([{"role": "user", "content": c}])[1] for c in CHAT[:15]]
    return [tokenizer.encode(p) for p in PLAIN[:15]] + chats


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(**ENGINE, speculative_config={"method": "off"})
    return [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    ]


def test_shipped_head_matches_its_checksum_and_the_target(smollm2: object) -> None:
    path = default_draft.default_head_path()
    weights = path / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == default_draft.HEAD_SHA256
    assert weights.stat().st_size <= 25 * 2**20
    from specbatch.models.llama import LlamaForCausalLM

    assert isinstance(smollm2, LlamaForCausalLM)
    head = load_head(path, smollm2)
    token_map = head.config.token_map
    assert token_map is not None
    assert len(set(token_map)) == len(token_map)
    assert max(token_map) < 49152
    assert head.config.target_vocab_size == 49152


def test_damaged_or_missing_head_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_draft, "HEAD_SHA256", "0" * 64)
    with pytest.raises(ModelLoadError, match="does not match the shipped draft head"):
        default_draft.default_head_path()
    monkeypatch.setattr(default_draft, "HEAD_SHA256", "")
    with pytest.raises(ConfigError, match="ships no draft head"):
        default_draft.default_head_path()


def test_head_for_another_target_is_a_clear_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="a draft head ships only for SmolLM2-135M-Instruct"):
        LLM(model=str(tiny_model_dir), speculative_config={"method": "eagle"})


def test_chains_at_batch_16_are_lossless_and_keep_their_acceptance(
    prompts: list[list[int]], reference: list[list[int]]
) -> None:
    spec = {
        "method": "eagle",
        "num_speculative_tokens": 4,
        "draft_confidence_threshold": 0.0,
        "adaptive_k": False,
    }
    llm = LLM(**ENGINE, speculative_config=spec)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference
    stats = llm.llm_engine.stats
    first = stats.num_accepted_tokens_per_pos[0] / stats.num_drafts
    assert first >= MIN_FIRST_ACCEPTANCE, f"first-draft acceptance {first:.3f}"
    assert isinstance(network_proposer(llm.llm_engine).net, HeadNetwork)


@pytest.mark.parametrize("batch", [1, 16])
def test_trees_are_lossless(
    prompts: list[list[int]], reference: list[list[int]], batch: int
) -> None:
    """The head's dynamic trees (the plan forced to chains of 3 with cheap rows, so trees
    grow at every batch size)."""
    engine = LLMEngine(EngineConfig(**ENGINE, speculative_config={"method": "eagle"}))
    force_draft_chains(engine, 3, row_seconds=1e-5)
    count = len(prompts) if batch > 1 else 10
    out = run_engine(engine, prompts[:count], PARAMS, batch)
    assert out == reference[:count]
    assert engine.stats.num_tree_drafts > 0
