"""SentencePiece vocabularies: the GGUF ``llama`` tokenizer and the ``tokenizer.model`` directory
both give the ``sentencepiece`` library's ids, byte fallback and user-defined pieces included."""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specbatch.tokenizer import Tokenizer, load_tokenizer
from specbatch.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from specbatch.tokenizer.spm_tokenizer import SPMTokenizer
from tests.tokenizer.vocab_files import spm_vocab_lists, train_spm, write_vocab_gguf

# Text the model never saw: emoji, CJK and Arabic exist only as byte pieces.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces, and pieces into ids.",
    "def tokenize(text):\n    return [p for p in text.split()]\n",
    "for i in range(10):\n\tprint(i * 2)\n",
    "Numbers like 42, 3.14159 and 1,000,000.",
    "Le café était très agréable, déjà à midi. Ångström naïve",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "中文字符测试，日本語のテキスト",
    "مرحبا بالعالم",
    "  leading spaces",
    "trailing spaces   ",
    "multiple     inner      spaces",
    "\n\nnewlines\r\n\n",
    "a <sep> b<sep>c",
    "<sep>starts with a user-defined piece",
    "x",
    " ",
    "",
]


@pytest.mark.parametrize("text", CORPUS)
def test_gguf_vocabulary_matches_sentencepiece(
    text: str, spm_gguf_tokenizer: Tokenizer, spm_processor: sentencepiece.SentencePieceProcessor
) -> None:
    assert isinstance(spm_gguf_tokenizer, SPMTokenizer)
    assert spm_gguf_tokenizer.encode(text, add_special_tokens=False) == spm_processor.encode(text)


@pytest.mark.parametrize("text", CORPUS)
def test_tokenizer_model_directory_matches_sentencepiece(
    text: str, spm_dir: Path, spm_processor: sentencepiece.SentencePieceProcessor
) -> None:
    tokenizer = load_tokenizer(spm_dir)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert tokenizer.encode(text, add_special_tokens=False) == spm_processor.encode(text)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trips(
    text: str, spm_gguf_tokenizer: Tokenizer, spm_processor: sentencepiece.SentencePieceProcessor
) -> None:
    ids = spm_gguf_tokenizer.encode(text)
    assert spm_gguf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert spm_processor.decode(ids) == text


_ALPHABET = st.sampled_from([*"abcdefghijklmnopqrstuvwxyz TQ.,'\n\té😀中ب<>", "<sep>"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_ALPHABET, max_size=40))
def test_random_text_matches_sentencepiece(
    pieces: list[str],
    spm_gguf_tokenizer: Tokenizer,
    spm_processor: sentencepiece.SentencePieceProcessor,
) -> None:
    text = "".join(pieces)
    # The library reads control-token spellings as plain text; specbatch gives their ids.
    assume(not any(control in text for control in ("<s>", "</s>")))
    assert spm_gguf_tokenizer.encode(text, add_special_tokens=False) == spm_processor.encode(text)


def test_bos_is_added_by_default(
    spm_gguf_tokenizer: Tokenizer,
    spm_dir: Path,
    spm_processor: sentencepiece.SentencePieceProcessor,
) -> None:
    for tokenizer in (spm_gguf_tokenizer, load_tokenizer(spm_dir)):
        assert tokenizer.bos_token_id == 1
        assert tokenizer.eos_token_id == 2
        assert tokenizer.eos_token_ids == frozenset({2})
        assert tokenizer.encode("hello") == [1, *spm_processor.encode("hello")]
        assert tokenizer.encode("hello", add_special_tokens=False) == spm_processor.encode("hello")


def test_control_tokens_in_text_are_single_ids(
    spm_gguf_tokenizer: Tokenizer,
    spm_dir: Path,
    spm_processor: sentencepiece.SentencePieceProcessor,
) -> None:
    # Each run between control tokens is encoded on its own, dummy-prefix space included.
    start, end = spm_processor.piece_to_id("<|im_start|>"), spm_processor.piece_to_id("<|im_end|>")
    expected = [start, *spm_processor.encode("user\nhi"), end, *spm_processor.encode("\n")]
    for tokenizer in (spm_gguf_tokenizer, load_tokenizer(spm_dir)):
        ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
        assert ids == expected
        assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"
        assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\n"
        assert tokenizer.all_special_ids >= {0, 1, 2, start, end}


def test_without_space_prefix(tmp_path: Path) -> None:
    model = train_spm(tmp_path / "plain", vocab_size=360, add_dummy_prefix=False)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    pieces, scores, types = spm_vocab_lists(model)
    path = write_vocab_gguf(
        tmp_path / "plain.gguf",
        "llama",
        pieces,
        types,
        scores,
        metadata={"bos_token_id": 1, "eos_token_id": 2, "add_space_prefix": False},
    )
    tokenizer = load_tokenizer(path)
    for text in CORPUS:
        assert tokenizer.encode(text, add_special_tokens=False) == processor.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == "<s>" + text
