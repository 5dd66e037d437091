"""Byte-level BPE: a ``tokenizer.json`` directory, the same vocabulary read from a GGUF, and the
word-splitting regexes chosen by ``tokenizer.ggml.pre``."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend

from specbatch.tokenizer import Tokenizer, load_tokenizer
from specbatch.tokenizer.byte_level import build_byte_level_bpe
from specbatch.tokenizer.hf_tokenizer import HFTokenizer
from tests.tokenizer.vocab_files import BPE_SPECIALS, byte_level_vocab_lists, write_vocab_gguf

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def tokenize(text):\n    return [p for p in text.split()]\n",
    "for i in range(10):\n\tprint(i * 2)\n",
    "Numbers like 42, 3.14159 and 1,000,000; x  42",
    "Le café était très agréable. Ångström naïve",
    "emoji 😀👍🏽 🇫🇷, 中文字符测试, مرحبا بالعالم",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|> <|im_end|> <|im_start",
    "  leading, trailing   , multiple     spaces",
    "\n\nnewlines\r\n\n",
    "I'm sure they'll say WE'VE",
    "",
]


@pytest.fixture(scope="module")
def reference(bpe_dir: Path) -> Backend:
    return Backend.from_file(str(bpe_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def gguf_tokenizer(bpe_dir: Path) -> Tokenizer:
    tokens, types, merges = byte_level_vocab_lists(bpe_dir)
    path = write_vocab_gguf(
        bpe_dir.parent / "bpe.gguf",
        "gpt2",
        tokens,
        types,
        merges=merges,
        metadata={"pre": "gpt2", "bos_token_id": 1, "eos_token_id": 2, "eot_token_id": 0},
    )
    return load_tokenizer(path)


@pytest.mark.parametrize("text", CORPUS)
def test_directory_and_gguf_match_the_library(
    text: str, reference: Backend, bpe_tokenizer: Tokenizer, gguf_tokenizer: Tokenizer
) -> None:
    expected = reference.encode(text, add_special_tokens=False).ids
    assert bpe_tokenizer.encode(text) == expected
    assert gguf_tokenizer.encode(text) == expected
    for tokenizer in (bpe_tokenizer, gguf_tokenizer):
        assert tokenizer.decode(expected) == text
        assert tokenizer.decode(expected, skip_special_tokens=True) == reference.decode(
            expected, skip_special_tokens=True
        )


def test_directory_configuration(bpe_tokenizer: Tokenizer) -> None:
    assert isinstance(bpe_tokenizer, HFTokenizer)
    assert bpe_tokenizer.bos_token_id == 1
    assert bpe_tokenizer.eos_token_id == 2
    assert bpe_tokenizer.eos_token_ids == frozenset({0, 2})  # generation_config.json adds 0
    assert bpe_tokenizer.pad_token_id is None
    assert not bpe_tokenizer.add_bos_token
    assert bpe_tokenizer.all_special_ids == frozenset({0, 1, 2})
    assert bpe_tokenizer.vocab_size == 500
    assert bpe_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gguf_configuration(gguf_tokenizer: Tokenizer) -> None:
    assert gguf_tokenizer.eos_token_ids == frozenset({0, 2})  # eot_token_id ends turns too
    assert gguf_tokenizer.encode("hi") == gguf_tokenizer.encode("hi", add_special_tokens=False)
    assert gguf_tokenizer.all_special_ids == frozenset({0, 1, 2})


def test_gguf_bos_flag_is_honoured(bpe_dir: Path, tmp_path: Path) -> None:
    tokens, types, merges = byte_level_vocab_lists(bpe_dir)
    meta = {"pre": "gpt2", "bos_token_id": 1, "eos_token_id": 2, "add_bos_token": True}
    path = write_vocab_gguf(
        tmp_path / "bos.gguf", "gpt2", tokens, types, merges=merges, metadata=meta
    )
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("hi")[0] == 1
    assert tokenizer.encode("hi")[1:] == tokenizer.encode("hi", add_special_tokens=False)


def _words(pre: str, text: str) -> list[str]:
    backend = build_byte_level_bpe(["a"], [1], [], pre, "test")
    assert backend.pre_tokenizer is not None
    return [word for word, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    ("pre", "text", "words"),
    [
        ("gpt2", "x  42 it's", ["x", "Ġ", "Ġ42", "Ġit", "'s"]),
        ("default", "12345", ["12345"]),
        # SmolLM/StarCoder cut digits apart first, so the spaces before a number stay together.
        ("smollm", "x  42", ["x", "ĠĠ", "4", "2"]),
        ("llama-bpe", "12345 IT'S", ["123", "45", "ĠIT", "'S"]),
        ("llama-bpe", "a\n\nb", ["a", "ĊĊ", "b"]),
        ("qwen2", "12345 ok", ["1", "2", "3", "4", "5", "Ġok"]),
    ],
)
def test_pre_tokenizer_regexes(pre: str, text: str, words: list[str]) -> None:
    assert _words(pre, text) == words


def test_unknown_pre_tokenizer_warns_and_uses_gpt2() -> None:
    with pytest.warns(UserWarning, match="unknown tokenizer.ggml.pre 'mystery'"):
        words = _words("mystery", "x  42")
    assert words == _words("gpt2", "x  42")


def test_control_tokens_are_matched_whole(gguf_tokenizer: Tokenizer) -> None:
    ids = gguf_tokenizer.encode("a<|im_end|>b<|endoftext|>")
    assert BPE_SPECIALS.index("<|im_end|>") in ids
    assert BPE_SPECIALS.index("<|endoftext|>") == ids[-1]
