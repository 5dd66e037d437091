"""SentencePiece's BPE segmentation, the algorithm of its ``bpe_model.cc``, in pure Python.

Start from single characters (user-defined pieces kept whole and never merged), then repeatedly
merge the adjacent pair whose concatenation is a vocabulary piece of the highest score, the
leftmost on ties. Characters left outside the vocabulary become their UTF-8 byte pieces (or
``<unk>``, runs of them merged into one, when the vocabulary has no byte pieces). A merged piece
marked unused is split back into the two pieces it came from.

Text is cut before each ``▁`` that follows another character, and each cut is cached: as no
piece spans such a point (checked at load; otherwise the text is segmented whole) this gives
the same ids as segmenting the whole text, much faster on real prompts.
"""

from __future__ import annotations

import heapq
import re

from specbatch.tokenizer.spm_vocab import SPACE, SPMVocab, TokenType

_CHUNK = re.compile(f"{SPACE}*[^{SPACE}]+|{SPACE}+")
_CROSSES_CUT = re.compile(f"[^{SPACE}]{SPACE}")
_CACHE_LIMIT = 1 << 16


class SentencePieceBPE:
    """Segments escaped text (spaces already ``▁``) into the ids of one `SPMVocab`."""

    def __init__(self, vocab: SPMVocab) -> None:
        self._scores = vocab.scores
        self._unused = set(vocab.ids_of(TokenType.UNUSED))
        self._ids: dict[str, int] = {}
        self._mergeable: dict[str, int] = {}
        user_defined: list[str] = []
        for token_id, (piece, kind) in enumerate(zip(vocab.pieces, vocab.types, strict=True)):
            if kind == TokenType.BYTE:
                continue
            self._ids.setdefault(piece, token_id)
            if kind in (TokenType.NORMAL, TokenType.USER_DEFINED, TokenType.UNUSED):
                self._mergeable.setdefault(piece, token_id)
            if kind == TokenType.USER_DEFINED and piece:
                user_defined.append(piece)
        self._bytes = {vocab.pieces[i]: i for i in vocab.ids_of(TokenType.BYTE)}
        self._unk = next(iter(vocab.ids_of(TokenType.UNKNOWN)), None)
        # Longest first, so a user-defined piece is matched whole before a shorter one.
        alternatives = [re.escape(p) for p in sorted(user_defined, key=len, reverse=True)]
        self._symbol = re.compile("|".join([*alternatives, "."]), re.DOTALL)
        self._user_defined = frozenset(user_defined)
        self._cuttable = not any(_CROSSES_CUT.search(p) for p in self._mergeable)
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, which must already spell spaces as ``▁``."""
        ids: list[int] = []
        for chunk in _CHUNK.findall(text) if self._cuttable else [text]:
            chunk_ids = self._cache.get(chunk)
            if chunk_ids is None:
                chunk_ids = self._segment(chunk)
                if len(self._cache) >= _CACHE_LIMIT:
                    self._cache.clear()
                self._cache[chunk] = chunk_ids
            ids.extend(chunk_ids)
        if not self._bytes and self._unk is not None:
            ids = _merge_unknown_runs(ids, self._unk)
        return ids

    def _segment(self, text: str) -> list[int]:
        pieces = self._symbol.findall(text)
        frozen = [p in self._user_defined for p in pieces]
        after = [*range(1, len(pieces)), -1]
        before = list(range(-1, len(pieces) - 1))
        heap: list[tuple[float, int, int, str]] = []
        origins: dict[str, tuple[str, str]] = {}

        def consider(left: int, right: int) -> None:
            if left < 0 or right < 0 or frozen[left] or frozen[right]:
                return
            merged = pieces[left] + pieces[right]
            token_id = self._mergeable.get(merged)
            if token_id is None:
                return
            heapq.heappush(heap, (-self._scores[token_id], left, right, merged))
            if token_id in self._unused:  # as SentencePiece: the last pair seen spelling it
                origins[merged] = (pieces[left], pieces[right])

        for index in range(len(pieces) - 1):
            consider(index, index + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            stale = not pieces[left] or after[left] != right
            if stale or pieces[left] + pieces[right] != merged:
                continue  # one side was merged elsewhere since this pair was queued
            pieces[left], pieces[right] = merged, ""
            after[left] = after[right]
            if after[right] >= 0:
                before[after[right]] = left
            consider(before[left], left)
            consider(left, after[left])
        ids: list[int] = []
        index = 0 if pieces else -1
        while index >= 0:
            self._emit(pieces[index], origins, ids)
            index = after[index]
        return ids

    def _emit(self, piece: str, origins: dict[str, tuple[str, str]], ids: list[int]) -> None:
        token_id = self._ids.get(piece)
        if token_id is None:
            ids.extend(self._fallback(piece))
        elif token_id in self._unused and piece in origins:
            first, second = origins[piece]
            self._emit(first, origins, ids)
            self._emit(second, origins, ids)
        else:
            ids.append(token_id)

    def _fallback(self, piece: str) -> list[int]:
        names = [f"<0x{byte:02X}>" for byte in piece.encode("utf-8")]
        if all(name in self._bytes for name in names):
            return [self._bytes[name] for name in names]
        if self._unk is None:
            raise ValueError(
                f"cannot encode {piece!r}: the vocabulary has neither its byte tokens nor <unk>"
            )
        return [self._unk]


def _merge_unknown_runs(ids: list[int], unk: int) -> list[int]:
    merged: list[int] = []
    for token_id in ids:
        if not (token_id == unk and merged and merged[-1] == unk):
            merged.append(token_id)
    return merged
