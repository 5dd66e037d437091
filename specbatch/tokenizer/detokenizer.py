"""Streaming generated ids as text, a few tokens at a time.

Decoding each token alone is wrong: a character can be split over several byte tokens, and a
decoder may treat the first token of its input specially (SentencePiece drops the space of its
first ``▁``). So each step decodes a short window twice, from an anchor token, up to the last
token already shown and up to the newest one, and emits the difference. Text that ends in an
incomplete character (U+FFFD), or whose last kept token is one of the tokenizer's
`provisional_ids`, is held back until a later token settles it or `flush` is called.

The anchor only ever moves to a token `decode` keeps, so the window's first kept token is never
treated as the start of the text unless it really is. Then the concatenation of everything
emitted equals ``tokenizer.decode(generated_ids, skip_special_tokens=...)``, and each step
decodes only the tokens since the previous step.
"""

from __future__ import annotations

from collections.abc import Sequence

from specbatch.tokenizer.base import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text increments.

    ``prompt_ids`` are kept for reference (`prompt_ids`) but are not decoded: the text streamed
    is that of the generated ids alone, exactly as ``tokenizer.decode`` gives it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self.prompt_ids = tuple(prompt_ids)
        self._skip = skip_special_tokens
        self._dropped = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._provisional = tokenizer.provisional_ids
        self._ids: list[int] = []
        self._anchor = 0  # first token of the decode window
        self._shown = 0  # tokens whose text has been emitted

    @property
    def output_ids(self) -> list[int]:
        """The generated ids pushed so far (a copy)."""
        return list(self._ids)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (possibly empty).

        Ids past the tokenizer's vocabulary (a model's embedding is often padded beyond it)
        have no text and are dropped.
        """
        size = self._tokenizer.vocab_size
        self._ids.extend(t for t in new_ids if 0 <= t < size)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any text held back for an incomplete character, at the end of generation."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._shown == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        before = decode(self._ids[self._anchor : self._shown], self._skip)
        after = decode(self._ids[self._anchor :], self._skip)
        if not final and self._unsettled(after):
            return ""
        self._move_anchor()
        self._shown = len(self._ids)
        return after[len(before) :]

    def _unsettled(self, text: str) -> bool:
        if text.endswith(_INCOMPLETE):
            return True
        for token_id in reversed(self._ids):  # the last token decode keeps
            if token_id not in self._dropped:
                return token_id in self._provisional
        return False

    def _move_anchor(self) -> None:
        # The next window starts at the first kept token among those just shown; when all of
        # them are dropped special tokens, the anchor stays where it is.
        for index in range(self._shown, len(self._ids)):
            if self._ids[index] not in self._dropped:
                self._anchor = index
                return
