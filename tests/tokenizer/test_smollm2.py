"""The default model's GGUF tokenizer against transformers' tokenizer built from the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import pre_tokenizers

from specbatch.tokenizer import Tokenizer, load_tokenizer
from specbatch.tokenizer.hf_tokenizer import HFTokenizer

pytestmark = pytest.mark.slow

CORPUS = [
    "Hello, world! This is a test of the tokenizer.",
    "def f(x):\n\tif x > 0:\n\t\treturn x  # tab-indented\n    else:\n        return -x\n",
    "class A:\n    def __init__(self) -> None:\n        self.items: list[int] = []\n",
    "Numbers: 3.14159, 1,000,000, 2024-05-01, 0x1F, 42nd, -7e10",
    "emoji 😀👍🏽🇫🇷 and ❤️ done",
    "café naïve résumé Ångström Œuvre façade",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "مرحبا بالعالم، كيف حالك؟",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|im_end|> <|im_start",
    "  leading spaces",
    "trailing spaces   ",
    "multiple     spaces   between words",
    "\n\n\nnewlines\r\n\r\n",
    "\ttabs\t\tand\ttext",
    "I'm sure they'll say we've DONE it, it's fine",
    "https://example.com/path?q=1&r=two#frag",
    "",
]
# Runs of spaces before a digit: transformers' GGUF conversion ignores tokenizer.ggml.pre and
# splits with GPT-2's regex, while SmolLM2's own tokenizer.json (and llama.cpp) cut the digits
# apart first. specbatch follows the original tokenizer; see test_spaces_before_digits.
SPACES_BEFORE_DIGITS = ["a  1", "x   42 y", "total:\t  100", "  7 up"]


@pytest.fixture(scope="module")
def original(hf_smollm2_tokenizer: Any) -> Any:
    """transformers' backend with SmolLM2's original pre-tokenizer restored."""
    backend = hf_smollm2_tokenizer.backend_tokenizer
    original = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    copy = type(backend).from_str(backend.to_str())
    copy.pre_tokenizer = original
    return copy


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_transformers(
    text: str, smollm2_tokenizer: Tokenizer, hf_smollm2_tokenizer: Any, original: Any
) -> None:
    assert smollm2_tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text)
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert ids == original.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", SPACES_BEFORE_DIGITS)
def test_spaces_before_digits(
    text: str, smollm2_tokenizer: Tokenizer, hf_smollm2_tokenizer: Any, original: Any
) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert ids == original.encode(text, add_special_tokens=False).ids
    assert ids != hf_smollm2_tokenizer.encode(text)  # the known transformers divergence
    assert smollm2_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", CORPUS)
def test_decode_matches_transformers(
    text: str, smollm2_tokenizer: Tokenizer, hf_smollm2_tokenizer: Any
) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text
    for skip in (False, True):
        expected = hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=skip) == expected


def test_special_tokens(smollm2_tokenizer: Tokenizer, hf_smollm2_tokenizer: Any) -> None:
    assert isinstance(smollm2_tokenizer, HFTokenizer)
    assert smollm2_tokenizer.vocab_size == 49152
    assert smollm2_tokenizer.bos_token_id == hf_smollm2_tokenizer.bos_token_id == 1
    assert smollm2_tokenizer.eos_token_id == hf_smollm2_tokenizer.eos_token_id == 2
    assert smollm2_tokenizer.pad_token_id == 2
    assert smollm2_tokenizer.eos_token_ids == frozenset({2})  # <|im_end|>
    assert not smollm2_tokenizer.add_bos_token  # the GGUF says add_bos_token = false
    assert smollm2_tokenizer.all_special_ids == frozenset(range(17))
    assert set(hf_smollm2_tokenizer.all_special_ids) <= smollm2_tokenizer.all_special_ids


CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And times 3? Answer with émojis 😀"},
]


@pytest.mark.parametrize("system", [None, "You are a terse assistant."])
def test_chat_template_matches_transformers(
    system: str | None, smollm2_tokenizer: Tokenizer, hf_smollm2_tokenizer: Any
) -> None:
    messages = [{"role": "system", "content": system}] if system else []
    messages += CONVERSATION
    expected = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt = smollm2_tokenizer.apply_chat_template(messages)
    assert prompt == expected
    assert smollm2_tokenizer.encode(prompt) == hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    without = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False
    )
    assert smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=False) == without


def test_saved_tokenizer_json_directory(
    tmp_path: Path, smollm2_tokenizer: Tokenizer, hf_smollm2_tokenizer: Any
) -> None:
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, HFTokenizer)
    for text in CORPUS:
        assert tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.chat_template == smollm2_tokenizer.chat_template
    assert tokenizer.apply_chat_template(CONVERSATION) == smollm2_tokenizer.apply_chat_template(
        CONVERSATION
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert tokenizer.eos_token_ids == frozenset({2})
    assert not tokenizer.add_bos_token
