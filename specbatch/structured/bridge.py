"""The model's tokenizer as llguidance sees it: every token's bytes, the end-of-sequence ids.

Both tokenizer kinds the project loads: a ``tokenizers`` backend (HF ``tokenizer.json``, and
the byte-level BPE of a GGUF file, built as one) is handed over whole; a SentencePiece
vocabulary (a GGUF ``llama`` tokenizer or ``tokenizer.model``) as its tokens' bytes (``▁`` a
space, ``<0xNN>`` its byte), with its own encoder for the text llguidance tokenizes (as a
continuation: without SentencePiece's dummy-prefix space).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llguidance

from specbatch.errors import ConfigError
from specbatch.tokenizer import HFTokenizer, Tokenizer
from specbatch.tokenizer.spm_vocab import SPMVocabTokenizer


class _Vocabulary:
    """What ``llguidance.LLTokenizer`` reads of a vocabulary that is not a ``tokenizers``
    backend (llguidance's ``TokenizerWrapper`` protocol)."""

    def __init__(self, tokenizer: SPMVocabTokenizer, eos: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens: Sequence[bytes] = tokenizer.token_surfaces()
        self.special_token_ids = sorted(tokenizer.all_special_ids)
        self.is_tokenizer_wrapper = True

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode_continuation(text)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """An ``llguidance.LLTokenizer`` for ``tokenizer`` over the model's ``vocab_size`` logits
    (ids past the tokenizer's are never allowed); ``ConfigError`` for a tokenizer without
    an end-of-sequence id (a constraint must be able to end)."""
    eos = sorted(tokenizer.eos_token_ids)
    if not eos:
        raise ConfigError("structured outputs need a tokenizer with an end-of-sequence token")
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, SPMVocabTokenizer):
        wrapper: Any = _Vocabulary(tokenizer, eos[0])
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
    raise ConfigError(f"structured outputs do not know the tokenizer {type(tokenizer).__name__}")
