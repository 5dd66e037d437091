"""Checks on text before it is tokenized."""

from __future__ import annotations

from specbatch.errors import InvalidRequestError


def check_text(text: str, param: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (JSON can carry a lone surrogate, which no
    tokenizer can encode), naming the field ``param``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
            f"character {exc.start}",
            param,
        ) from None
