"""Paths without a usable tokenizer fail with a `ModelLoadError` that names the path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specbatch.errors import ModelLoadError
from specbatch.tokenizer import load_tokenizer
from tests.tokenizer.vocab_files import byte_level_vocab_lists, write_vocab_gguf


def expect_error(path: Path, message: str, named: Path | None = None) -> None:
    """Loading ``path`` fails with ``message``, naming ``named`` (by default ``path``)."""
    with pytest.raises(ModelLoadError, match=re.escape(str(named or path)) + ".*" + message):
        load_tokenizer(path)


def test_directory_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    expect_error(tmp_path, "looked for tokenizer.json and tokenizer.model")


def test_missing_path(tmp_path: Path) -> None:
    expect_error(tmp_path / "nowhere", "no such file or directory")


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    expect_error(path, "expected a .gguf file")


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / "bare.gguf", None)
    expect_error(path, "carries no tokenizer")


def test_gguf_with_unsupported_tokenizer_model(tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / "bert.gguf", "bert", ["[CLS]", "a"], [3, 1])
    expect_error(path, "'bert'.*'gpt2'.*'llama'")


def test_gguf_byte_level_without_merges(tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / "nomerges.gguf", "gpt2", ["a", "b"], [1, 1])
    expect_error(path, "without tokenizer.ggml.merges")


def test_gguf_sentencepiece_without_scores(tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / "noscores.gguf", "llama", ["<unk>", "a"], [2, 1])
    expect_error(path, "without tokenizer.ggml.scores")


def test_gguf_token_types_of_the_wrong_length(tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / "types.gguf", "llama", ["a", "b"], [1], [0.0, 0.0])
    expect_error(path, "token_type should list one entry per token")


def test_gguf_special_id_outside_the_vocabulary(bpe_dir: Path, tmp_path: Path) -> None:
    tokens, types, merges = byte_level_vocab_lists(bpe_dir)
    meta = {"eos_token_id": 100_000}
    path = write_vocab_gguf(
        tmp_path / "eos.gguf", "gpt2", tokens, types, merges=merges, metadata=meta
    )
    expect_error(path, "eos_token_id is 100000, outside the vocabulary of 500 tokens")


def test_config_naming_a_token_not_in_the_vocabulary(bpe_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>"}))
    expect_error(tmp_path, "bos_token '<nope>', which is not in the vocabulary")


def test_corrupt_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    expect_error(tmp_path, "cannot load it", tmp_path / "tokenizer.json")
    sp_dir = tmp_path / "sp"
    sp_dir.mkdir()
    (sp_dir / "tokenizer.model").write_bytes(b"garbage")
    expect_error(sp_dir, "not a SentencePiece model", sp_dir / "tokenizer.model")
