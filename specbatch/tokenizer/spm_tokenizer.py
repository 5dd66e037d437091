"""A SentencePiece BPE tokenizer over a vocabulary given as lists (GGUF ``llama`` vocabularies).

Control tokens written in the text (``<s>``, ``[INST]``-style tokens marked control) are cut out
first and become their ids. Every other run gets SentencePiece's treatment: a dummy-prefix space
when it starts the input or follows a control token (as the original Llama and Mistral code did
by encoding each run on its own), spaces spelled ``▁``, then `SentencePieceBPE`.
"""

from __future__ import annotations

from specbatch.tokenizer.base import SpecialTokens
from specbatch.tokenizer.special_split import SpecialTokenSplitter
from specbatch.tokenizer.spm_bpe import SentencePieceBPE
from specbatch.tokenizer.spm_vocab import SPACE, SPMVocab, SPMVocabTokenizer, TokenType


class SPMTokenizer(SPMVocabTokenizer):
    """SentencePiece-compatible BPE with byte fallback over an `SPMVocab`."""

    def __init__(self, vocab: SPMVocab, special: SpecialTokens) -> None:
        super().__init__(vocab, special)
        self._bpe = SentencePieceBPE(vocab)
        control = {vocab.pieces[i]: i for i in reversed(vocab.ids_of(TokenType.CONTROL))}
        self._splitter = SpecialTokenSplitter(control)

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
