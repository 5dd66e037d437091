"""SentencePiece BPE segmentation on hand-made vocabularies, where the right ids are obvious."""

from __future__ import annotations

import pytest

from specbatch.tokenizer.spm_bpe import SentencePieceBPE
from specbatch.tokenizer.spm_vocab import SPMVocab, TokenType

N, U, C, UD, X, B = (
    TokenType.NORMAL,
    TokenType.UNKNOWN,
    TokenType.CONTROL,
    TokenType.USER_DEFINED,
    TokenType.UNUSED,
    TokenType.BYTE,
)


def bpe(entries: list[tuple[str, float, TokenType]]) -> tuple[SentencePieceBPE, dict[str, int]]:
    pieces, scores, types = zip(*entries, strict=True)
    vocab = SPMVocab(tuple(pieces), tuple(scores), tuple(int(t) for t in types))
    return SentencePieceBPE(vocab), {p: i for i, p in enumerate(pieces)}


BASE = [("<unk>", 0.0, U), ("<s>", 0.0, C), ("a", -1.0, N), ("b", -1.0, N), ("c", -1.0, N)]


def test_highest_score_merges_first() -> None:
    model, ids = bpe([*BASE, ("ab", -3.0, N), ("bc", -2.0, N)])
    assert model.encode("abc") == [ids["a"], ids["bc"]]
    model, ids = bpe([*BASE, ("ab", -1.5, N), ("bc", -2.0, N)])
    assert model.encode("abc") == [ids["ab"], ids["c"]]


def test_ties_go_to_the_leftmost_pair() -> None:
    model, ids = bpe([*BASE, ("aa", -2.0, N)])
    assert model.encode("aaa") == [ids["aa"], ids["a"]]


def test_unused_piece_is_split_back_into_its_halves() -> None:
    model, ids = bpe([*BASE, ("ab", -2.0, X), ("abc", -3.0, N)])
    assert model.encode("ab") == [ids["a"], ids["b"]]
    # An unused piece can still be a step towards a used one.
    assert model.encode("abc") == [ids["abc"]]


def test_user_defined_pieces_stay_whole_and_never_merge() -> None:
    model, ids = bpe([*BASE, ("<x>", 0.0, UD), ("a<", -2.0, N), ("ab", -2.0, N)])
    assert model.encode("a<x>ab") == [ids["a"], ids["<x>"], ids["ab"]]


def test_unknown_characters_fall_back_to_bytes() -> None:
    bytes_ = [(f"<0x{b:02X}>", 0.0, B) for b in range(256)]
    model, ids = bpe([*BASE, *bytes_])
    assert model.encode("aé") == [ids["a"], ids["<0xC3>"], ids["<0xA9>"]]


def test_without_byte_pieces_a_run_of_unknowns_is_one_unk() -> None:
    model, ids = bpe(BASE)
    assert model.encode("aéé😀b") == [ids["a"], ids["<unk>"], ids["b"]]


def test_misspelled_byte_piece_is_rejected() -> None:
    with pytest.raises(ValueError, match="<0xZZ>"):
        bpe([*BASE, ("<0xZZ>", 0.0, B)])
