"""A SentencePiece BPE tokenizer over a vocabulary given as lists (GGUF ``llama`` vocabularies).

Control tokens written in the text (``<s>``, ``[INST]``-style tokens marked control) are cut out
first and become their ids. Every other run gets SentencePiece's treatment: a dummy-prefix space
when it starts the input or follows a control token (as the original Llama and Mistral code did
by encoding each run on its own), spaces spelled ``▁``, then `SentencePieceBPE`.
"""

from __future__ import annotations

from collections.abc import Sequence

from specbatch.tokenizer.base import SpecialTokens, Tokenizer
from specbatch.tokenizer.special_split import SpecialTokenSplitter
from specbatch.tokenizer.spm_bpe import SentencePieceBPE
from specbatch.tokenizer.spm_vocab import SPACE, SPMVocab, TokenType


class SPMTokenizer(Tokenizer):
    """SentencePiece-compatible BPE with byte fallback over an `SPMVocab`."""

    def __init__(self, vocab: SPMVocab, special: SpecialTokens) -> None:
        super().__init__(special)
        self._vocab = vocab
        self._bpe = SentencePieceBPE(vocab)
        self._ids: dict[str, int] = {}
        for token_id, piece in enumerate(vocab.pieces):
            self._ids.setdefault(piece, token_id)
        control = {vocab.pieces[i]: i for i in reversed(vocab.ids_of(TokenType.CONTROL))}
        self._splitter = SpecialTokenSplitter(control)
        self._special_ids = vocab.special_ids()

    def _encode_text(self, text: str) -> list[int]:
        ids: list[int] = []
        prefix = self._vocab.add_space_prefix
        for run, token_id in self._splitter.split(text):
            if token_id is not None:
                ids.append(token_id)
                prefix = self._vocab.add_space_prefix
                continue
            if prefix:
                run = " " + run
                prefix = False
            ids.extend(self._bpe.encode(run.replace(" ", SPACE)))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._vocab.decode(ids, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids
