"""Streaming detokenization: everything pushed, joined, equals one decode of all the ids."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXTS = [
    "Hello world, this is streamed.",
    "emoji 😀👍🏽🇫🇷 in the middle, then 中文字符测试 and مرحبا",
    "  leading spaces and\n\tcode\n",
    "é",
    "😀",
]


def stream(
    tokenizer: Tokenizer, ids: Sequence[int], chunks: Sequence[int], skip: bool
) -> list[str]:
    """Push ``ids`` in chunks of the given sizes (cycled); return every increment and the flush."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=[5, 6, 7], skip_special_tokens=skip)
    pieces, start, turn = [], 0, 0
    while start < len(ids):
        size = chunks[turn % len(chunks)] if chunks else 1
        pieces.append(detokenizer.push(list(ids[start : start + size])))
        start, turn = start + size, turn + 1
    pieces.append(detokenizer.flush())
    assert detokenizer.output_ids == list(ids)
    return pieces


@pytest.fixture(scope="module", params=["bpe_dir", "spm_gguf", "spm_dir", "llama2_style_dir"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    source: Path = request.getfixturevalue(request.param)
    return load_tokenizer(source)


@settings(max_examples=150, deadline=None)
@given(
    fractions=st.lists(st.floats(0, 1, exclude_max=True), max_size=40),
    chunks=st.lists(st.integers(1, 3), max_size=5),
    skip=st.booleans(),
)
def test_random_ids_stream_to_the_one_shot_decode(
    tokenizer: Tokenizer, fractions: list[float], chunks: list[int], skip: bool
) -> None:
    ids = [int(f * tokenizer.vocab_size) for f in fractions]
    pieces = stream(tokenizer, ids, chunks, skip)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", TEXTS)
def test_text_streams_one_token_at_a_time(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids, [1], skip=True)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)  # never half a character


def test_first_token_has_no_leading_space(spm_gguf_tokenizer: Tokenizer) -> None:
    # The dummy-prefix space of the first token is dropped, as decode drops it.
    ids = spm_gguf_tokenizer.encode("the fox", add_special_tokens=False)
    assert spm_gguf_tokenizer.decode(ids[:1]) == "the"
    pieces = stream(spm_gguf_tokenizer, ids, [1], skip=True)
    assert pieces[0] == "the"
    assert pieces[1].startswith(" f")


def test_special_token_between_words(tokenizer: Tokenizer) -> None:
    # With the special token skipped, a window starting at it would make "▁fox" look like the
    # start of the text, and a SentencePiece-style decoder would drop its space.
    assert tokenizer.eos_token_id is not None
    words = [tokenizer.encode(w, add_special_tokens=False) for w in ("the", "fox", "jumps")]
    ids = [*words[0], tokenizer.eos_token_id, *words[1], tokenizer.eos_token_id, *words[2]]
    for skip in (True, False):
        for chunks in ([1], [2], [1, 2]):
            pieces = stream(tokenizer, ids, chunks, skip)
            assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_incomplete_character_is_held_until_flush(spm_gguf_tokenizer: Tokenizer) -> None:
    first_byte = spm_gguf_tokenizer.token_to_id("<0xF0>")
    assert first_byte is not None
    detokenizer = IncrementalDetokenizer(spm_gguf_tokenizer, [], skip_special_tokens=True)
    assert detokenizer.push([first_byte]) == ""
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.flush() == ""


class CountingTokenizer:
    """Wraps a tokenizer and records the longest window `decode` was given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.longest = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens)


def test_each_push_decodes_only_a_short_window(bpe_tokenizer: Tokenizer) -> None:
    text = "A long answer with 😀 emoji and 中文 keeps streaming. " * 40
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 500
    counting = CountingTokenizer(bpe_tokenizer)
    detokenizer = IncrementalDetokenizer(counting, [])  # type: ignore[arg-type]
    out = "".join(detokenizer.push([token_id]) for token_id in ids) + detokenizer.flush()
    assert out == text
    assert counting.longest <= 8


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_streams_exactly(smollm2_tokenizer: Tokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text + "<|im_end|>")
    for skip in (True, False):
        pieces = stream(smollm2_tokenizer, ids, [1], skip)
        assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in piece for piece in pieces)
