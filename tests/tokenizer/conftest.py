"""Tokenizer fixtures: tiny vocabularies trained offline, and the default model's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sentencepiece

from specbatch.tokenizer import Tokenizer, load_tokenizer
from tests.tokenizer.vocab_files import (
    spm_vocab_lists,
    train_byte_level_bpe,
    train_spm,
    write_llama2_style_tokenizer_json,
    write_vocab_gguf,
)

SPM_GGUF_IDS = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}


@pytest.fixture(scope="session")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only a tiny byte-fallback SentencePiece ``tokenizer.model``."""
    directory = tmp_path_factory.mktemp("spm")
    train_spm(directory)
    return directory


@pytest.fixture(scope="session")
def spm_processor(spm_dir: Path) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))


@pytest.fixture(scope="session")
def spm_gguf(spm_dir: Path) -> Path:
    """The tiny SentencePiece vocabulary written as a GGUF ``llama`` tokenizer."""
    pieces, scores, types = spm_vocab_lists(spm_dir / "tokenizer.model")
    return write_vocab_gguf(
        spm_dir.parent / "spm.gguf", "llama", pieces, types, scores, metadata=SPM_GGUF_IDS
    )


@pytest.fixture(scope="session")
def spm_gguf_tokenizer(spm_gguf: Path) -> Tokenizer:
    return load_tokenizer(spm_gguf)


@pytest.fixture(scope="session")
def llama2_style_dir(spm_dir: Path) -> Path:
    """A tokenizer.json directory with Llama 2's decoders over the tiny SentencePiece vocabulary."""
    return write_llama2_style_tokenizer_json(
        spm_dir.parent / "llama2_style", spm_dir / "tokenizer.model"
    )


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE model directory (tokenizer.json + configuration files)."""
    return train_byte_level_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="session")
def bpe_tokenizer(bpe_dir: Path) -> Tokenizer:
    return load_tokenizer(bpe_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_gguf: Path) -> Tokenizer:
    """The default model's tokenizer, read from its GGUF by specbatch."""
    return load_tokenizer(default_gguf)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(default_gguf: Path) -> Any:
    """The reference: transformers' tokenizer built from the same GGUF (~10 s)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name
    )
