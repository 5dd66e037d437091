"""Tokenizers: text to ids and back, chat templates, and streaming detokenization.

`load_tokenizer` is the one entry point: a ``.gguf`` file uses the vocabulary in its metadata, a
directory uses its ``tokenizer.json`` (the ``tokenizers`` library) or else its
``tokenizer.model`` (the ``sentencepiece`` library).
"""

from __future__ import annotations

from pathlib import Path

from specbatch.errors import ModelLoadError
from specbatch.tokenizer.base import SpecialTokens, Tokenizer
from specbatch.tokenizer.detokenizer import IncrementalDetokenizer
from specbatch.tokenizer.gguf_tokenizer import load_gguf_tokenizer
from specbatch.tokenizer.hf_tokenizer import HFTokenizer
from specbatch.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

__all__ = ["IncrementalDetokenizer", "SpecialTokens", "Tokenizer", "load_tokenizer"]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file or a Hugging Face model directory.

    Raises `ModelLoadError` naming ``path`` when it holds no tokenizer specbatch can read.
    """
    path = Path(path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf_tokenizer(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer.from_directory(path)
        if (path / "tokenizer.model").is_file():
            return SentencePieceTokenizer.from_directory(path)
        raise ModelLoadError(
            f"{path}: no tokenizer in this directory; looked for tokenizer.json and tokenizer.model"
        )
    if path.exists():
        raise ModelLoadError(
            f"{path}: not a tokenizer source; expected a .gguf file or a directory containing "
            "tokenizer.json or tokenizer.model"
        )
    raise ModelLoadError(f"{path}: no such file or directory")
