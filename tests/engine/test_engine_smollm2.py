"""The engine on the real default model (float32): batch invariance and chat."""

from __future__ import annotations

import pytest

from specbatch import LLM, SamplingParams
from tests.prompts import PLAIN

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, num_kv_blocks=1024, max_num_batched_tokens=512)


def test_batch_of_24_equals_each_alone(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    plain = PLAIN[:12]
    prompts = plain + [
        tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in plain
    ]
    assert len(prompts) == 24
    params = SamplingParams(temperature=0.0, max_tokens=24)
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, together, strict=True):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, prompt


def test_chat_answers_a_simple_question(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
