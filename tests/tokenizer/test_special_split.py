"""Cutting text at special tokens: leftmost-longest matches, plain runs kept in order."""

from __future__ import annotations

from specbatch.tokenizer.special_split import SpecialTokenSplitter


def test_longest_token_wins_at_a_position() -> None:
    splitter = SpecialTokenSplitter({"<|im": 5, "<|im_end|>": 7, "": 9})
    assert list(splitter.split("a<|im_end|>b<|imx")) == [
        ("a", None),
        ("<|im_end|>", 7),
        ("b", None),
        ("<|im", 5),
        ("x", None),
    ]


def test_adjacent_tokens_and_text_without_any() -> None:
    splitter = SpecialTokenSplitter({"<s>": 1, "</s>": 2})
    assert list(splitter.split("<s></s>")) == [("<s>", 1), ("</s>", 2)]
    assert list(splitter.split("plain")) == [("plain", None)]
    assert list(splitter.split("")) == []
    assert list(SpecialTokenSplitter({}).split("x")) == [("x", None)]
