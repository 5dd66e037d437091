"""A SentencePiece-style vocabulary (pieces, scores, kinds) and how its ids become text.

Pieces spell a space as ``▁``; ``<0xNN>`` pieces stand for single bytes, so characters missing
from the vocabulary survive as their UTF-8 bytes ("byte fallback"). A text run that starts the
input or follows a control token gets one leading space ("dummy prefix") when encoded, and
decoding removes it again at the same places, so ``decode(encode(text)) == text``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from specbatch.tokenizer.base import SpecialTokens, Tokenizer

SPACE = "▁"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenType(IntEnum):
    """Token kinds as GGUF's ``tokenizer.ggml.token_type`` and SentencePiece number them."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class SPMVocab:
    """Pieces with their scores and kinds, indexed by id."""

    pieces: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]
    add_space_prefix: bool = True
    _surface: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not len(self.pieces) == len(self.scores) == len(self.types):
            raise ValueError(
                f"vocabulary lists disagree: {len(self.pieces)} pieces, {len(self.scores)} "
                f"scores, {len(self.types)} token types"
            )
        object.__setattr__(self, "_surface", tuple(map(self._piece_bytes, self.pieces, self.types)))
        ids: dict[str, int] = {}
        for token_id, piece in enumerate(self.pieces):
            ids.setdefault(piece, token_id)  # the first id of a repeated piece
        object.__setattr__(self, "_ids", ids)

    @staticmethod
    def _piece_bytes(piece: str, kind: int) -> bytes:
        if kind == TokenType.BYTE:
            match = _BYTE_PIECE.fullmatch(piece)
            if match is None:
                raise ValueError(f"byte token {piece!r} is not spelled <0xNN>")
            return bytes([int(match.group(1), 16)])
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            return piece.encode("utf-8")
        return piece.replace(SPACE, " ").encode("utf-8")

    def __len__(self) -> int:
        return len(self.pieces)

    def surface(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (``▁`` as a space, a byte piece as its byte)."""
        return self._surface[token_id]

    def id_of(self, piece: str) -> int | None:
        """The id of ``piece`` (the first, if the vocabulary repeats it)."""
        return self._ids.get(piece)

    def ids_of(self, *kinds: TokenType) -> list[int]:
        """Ids of the tokens of the given kinds, in id order."""
        return [i for i, kind in enumerate(self.types) if kind in kinds]

    def special_ids(self) -> frozenset[int]:
        """Ids `decode` drops when asked to skip special tokens."""
        return frozenset(self.ids_of(TokenType.CONTROL, TokenType.UNKNOWN))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``: ``▁`` as space, byte pieces joined into characters."""
        out = bytearray()
        strip = self.add_space_prefix  # the dummy prefix sits at the start and after control
        size = len(self.pieces)
        for token_id in ids:
            if not 0 <= token_id < size:
                raise ValueError(f"token id {token_id} is outside the vocabulary of {size} tokens")
            kind = self.types[token_id]
            surface = self._surface[token_id]
            if kind == TokenType.CONTROL or kind == TokenType.UNKNOWN:
                if not skip_special_tokens:
                    out += surface
                strip = kind == TokenType.CONTROL and self.add_space_prefix
                continue
            if strip and kind != TokenType.BYTE and surface.startswith(b" "):
                surface = surface[1:]
            strip = False
            out += surface
        return out.decode("utf-8", errors="replace")


class SPMVocabTokenizer(Tokenizer):
    """What every tokenizer over an `SPMVocab` shares: decoding, piece lookup, special ids.
    Subclasses encode (``_encode_text``)."""

    def __init__(self, vocab: SPMVocab, special: SpecialTokens) -> None:
        super().__init__(special)
        self._vocab = vocab
        self._special_ids = vocab.special_ids()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._vocab.decode(ids, skip_special_tokens)

    def token_surfaces(self) -> list[bytes]:
        """Every token's bytes, in id order (what grammar engines match text against)."""
        return [self._vocab.surface(i) for i in range(len(self._vocab))]

    def encode_continuation(self, text: str) -> list[int]:
        """The ids of ``text`` as it continues a sequence: no dummy-prefix space, control
        tokens' text left as text (what grammar engines tokenize forced text with)."""
        anchor = self._vocab.pieces[0]  # <unk>-like: encodes apart from what follows
        first = self._encode_text(anchor)
        ids = self._encode_text(anchor + text)
        if ids[: len(first)] == first:
            return ids[len(first) :]
        return self._encode_text(text)  # (the anchor merged into the text: a close second)

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.id_of(token)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids
