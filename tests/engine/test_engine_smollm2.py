"""The engine on the real default model (float32): batch invariance and chat."""

from __future__ import annotations

import pytest

from specbatch import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
    "List three primary colors:",
    "The theory of relativity states that",
    "import numpy as np\n\ndef normalize(x):",
    "Translate to French: Good morning, how are you?",
    "Q: What is 12 times 7?\nA:",
    "The best way to learn a new language is",
    "Write a SQL query that selects all users",
    "Photosynthesis is the process by which",
    "My favourite recipe for pancakes:",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, num_kv_blocks=1024, max_num_batched_tokens=512)


def test_batch_of_24_equals_each_alone(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = PROMPTS + [
        tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS
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
