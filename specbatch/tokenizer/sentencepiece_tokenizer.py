"""A ``tokenizer.model`` directory, encoded by the ``sentencepiece`` library itself.

The library applies the model's own normalisation and segmentation. Control tokens written in
the text (``<s>``, ``</s>``) and the extra tokens of ``tokenizer_config.json``'s
``added_tokens_decoder`` are cut out first, so each run between them is encoded on its own with
its dummy-prefix space, as in `SPMTokenizer`. Decoding goes through the same `SPMVocab` code.
"""

from __future__ import annotations

from pathlib import Path

import sentencepiece

from specbatch.errors import ModelLoadError
from specbatch.tokenizer.base import SpecialTokens
from specbatch.tokenizer.hf_config import HFTokenizerConfig
from specbatch.tokenizer.special_split import SpecialTokenSplitter
from specbatch.tokenizer.spm_vocab import SPACE, SPMVocab, SPMVocabTokenizer, TokenType


class SentencePieceTokenizer(SPMVocabTokenizer):
    """Wraps a ``sentencepiece.SentencePieceProcessor`` plus the directory's configuration."""

    def __init__(
        self,
        processor: sentencepiece.SentencePieceProcessor,
        config: HFTokenizerConfig,
    ) -> None:
        vocab = _vocab(processor, config)
        reserved = SpecialTokens(
            bos_token_id=_optional(processor.bos_id()),
            eos_token_id=_optional(processor.eos_id()),
            pad_token_id=_optional(processor.pad_id()),
            add_bos=True,  # what Llama-style tokenizer.model directories expect by default
        )
        super().__init__(vocab, config.special_tokens(vocab.id_of, reserved))
        self._processor = processor
        # The library cannot encode tokens added beyond its model, so those are cut out too.
        cut = [*vocab.ids_of(TokenType.CONTROL), *range(processor.GetPieceSize(), len(vocab))]
        self._splitter = SpecialTokenSplitter({vocab.pieces[i]: i for i in reversed(cut)})

    @classmethod
    def from_directory(cls, directory: Path) -> SentencePieceTokenizer:
        """Load ``directory/tokenizer.model`` and the configuration files next to it."""
        path = directory / "tokenizer.model"
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.Load(str(path))
        except (OSError, RuntimeError) as exc:
            raise ModelLoadError(f"{path}: not a SentencePiece model: {exc}") from None
        tokenizer = cls(processor, HFTokenizerConfig.read(directory))
        tokenizer._special.check(tokenizer.vocab_size, str(directory))
        return tokenizer

    def _encode_text(self, text: str) -> list[int]:
        ids: list[int] = []
        for run, token_id in self._splitter.split(text):
            if token_id is not None:
                ids.append(token_id)
            else:
                ids.extend(self._processor.EncodeAsIds(run))
        return ids


def _optional(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None  # sentencepiece's -1 means "none reserved"


def _vocab(processor: sentencepiece.SentencePieceProcessor, config: HFTokenizerConfig) -> SPMVocab:
    size = processor.GetPieceSize()
    pieces = [processor.IdToPiece(i) for i in range(size)]
    scores = [processor.GetScore(i) for i in range(size)]
    types = [_kind(processor, i) for i in range(size)]
    # Tokens added beyond the model (e.g. a <pad> at 32000) are control tokens of their own.
    for token_id, entry in sorted(config.added_tokens.items()):
        if token_id < size:
            continue
        while len(pieces) < token_id:  # ids skipped by the configuration decode to nothing
            pieces.append("")
            scores.append(0.0)
            types.append(TokenType.CONTROL)
        pieces.append(entry.content)
        scores.append(0.0)
        types.append(TokenType.CONTROL if entry.special else TokenType.USER_DEFINED)
    # A model adds the dummy prefix iff the first piece of a plain word starts with it.
    first = processor.EncodeAsPieces("a")
    add_space_prefix = bool(first) and first[0].startswith(SPACE)
    return SPMVocab(tuple(pieces), tuple(scores), tuple(types), add_space_prefix)


def _kind(processor: sentencepiece.SentencePieceProcessor, token_id: int) -> TokenType:
    if processor.IsControl(token_id):
        return TokenType.CONTROL
    if processor.IsUnknown(token_id):
        return TokenType.UNKNOWN
    if processor.IsByte(token_id):
        return TokenType.BYTE
    if processor.IsUnused(token_id):
        return TokenType.UNUSED
    return TokenType.NORMAL
