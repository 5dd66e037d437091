"""Cutting text at the special tokens written in it, so each one becomes its own id.

A prompt such as ``"<|im_start|>user\\nhi<|im_end|>"`` must give the id of ``<|im_start|>``, not
the pieces of its characters. Matches are leftmost-longest, as in Hugging Face's added-token
matching: at each position the longest special token wins (``<|im_end|>`` before ``<|im``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping


class SpecialTokenSplitter:
    """Splits text into plain runs and special tokens given as ``{text: id}``."""

    def __init__(self, specials: Mapping[str, int]) -> None:
        self._ids = {text: token_id for text, token_id in specials.items() if text}
        # Longest first, so the regex alternation takes the longest token at a position.
        ordered = sorted(self._ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def split(self, text: str) -> Iterator[tuple[str, int | None]]:
        """Yield ``(run, None)`` for plain text and ``(token, id)`` for each special token.

        Empty runs are not yielded.
        """
        if self._pattern is None:
            if text:
                yield text, None
            return
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                yield text[start : match.start()], None
            yield match.group(), self._ids[match.group()]
            start = match.end()
        if start < len(text):
            yield text[start:], None
