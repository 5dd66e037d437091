"""The tokenizer bridge: llguidance sees each token of both tokenizer kinds as exactly the bytes
the project's own tokenizer decodes it to, special tokens as special, and a constraint's mask
is the set of tokens a slow, obvious enumeration of the language allows."""

from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from specbatch.sampling_params import StructuredOutputsParams
from specbatch.structured.bridge import grammar_tokenizer
from specbatch.structured.manager import Constraints
from specbatch.tokenizer import Tokenizer, load_tokenizer
from specbatch.tokenizer.spm_vocab import SPMVocabTokenizer


@pytest.fixture(scope="module")
def smollm2_tokenizer(default_gguf: Path) -> Tokenizer:
    return load_tokenizer(default_gguf)


@pytest.fixture(params=["smollm2", "spm"])
def tokenizer(
    request: pytest.FixtureRequest, smollm2_tokenizer: Tokenizer, spm_gguf_tokenizer: Tokenizer
) -> Tokenizer:
    return smollm2_tokenizer if request.param == "smollm2" else spm_gguf_tokenizer


def _constraints(tokenizer: Tokenizer, backend: str = "llguidance") -> Constraints:
    return Constraints(tokenizer, tokenizer.vocab_size, backend)


BACKENDS = [
    "llguidance",
    pytest.param(
        "xgrammar",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed"
        ),
    ),
]


def test_every_token_is_the_bytes_the_tokenizer_decodes(tokenizer: Tokenizer) -> None:
    kind = "smollm2" if tokenizer.vocab_size > 10_000 else "spm"
    grammar = grammar_tokenizer(tokenizer, tokenizer.vocab_size)
    rng = random.Random(0)
    special = tokenizer.all_special_ids
    ordinary = [i for i in range(tokenizer.vocab_size) if i not in special]
    for token in special:
        assert grammar.is_special_token(token), token
    # (a byte token may be marked special: llguidance reserves the byte 0xFF, which no UTF-8
    # text holds; text tokens never are)
    texts = [t for t in ordinary if "\ufffd" not in tokenizer.decode([t])]
    for token in rng.sample(texts, min(300, len(texts))):
        assert not grammar.is_special_token(token), token
    # sequences mixing every kind of token (byte tokens included): llguidance's bytes,
    # joined, are the text the tokenizer decodes
    checked = 0
    for _ in range(400):
        seq = [rng.choice(ordinary) for _ in range(rng.randint(1, 6))]
        joined = b"".join(grammar.decode_bytes([t]) for t in seq)
        try:
            text = joined.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a byte token alone: not text
        decoded = tokenizer.decode(seq)
        if kind == "spm" and text.startswith(" "):
            decoded = " " + decoded  # SentencePiece decoding drops the text's first space
        assert text == decoded, seq
        checked += 1
    assert checked > 100
    text = "naïve café ✓ 東京"  # multi-byte characters: byte tokens in both vocabularies
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(grammar.decode_bytes([t]) for t in ids).decode().lstrip(" ") == text


def _language(choices: list[str]) -> set[bytes]:
    return {c.encode() for c in choices}


@pytest.mark.parametrize(
    ("regex", "words"),
    [
        (
            "[ab]{1,3}x",
            ["".join(p) + "x" for n in (1, 2, 3) for p in itertools.product("ab", repeat=n)],
        ),
        ("(é|ü)[0-9]", [a + d for a in "éü" for d in "0123456789"]),
        ("yes|no|maybe", ["yes", "no", "maybe"]),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_is_the_tokens_a_prefix_of_the_language_allows(
    tokenizer: Tokenizer, regex: str, words: list[str], backend: str
) -> None:
    """Slow reference: after the committed bytes, a token is allowed when its bytes extend
    them to a prefix of some word; the end of sequence once they are a whole word. Where
    the rest is forced (one word left), llguidance allows only the first token of the
    rest's canonical tokenization (the tokenizer's own), the way the model was trained
    (xgrammar allows every spelling)."""
    constraints = _constraints(tokenizer, backend)
    grammar = grammar_tokenizer(tokenizer, tokenizer.vocab_size)
    language = _language(words)
    surfaces = [
        b"" if grammar.is_special_token(t) else grammar.decode_bytes([t])
        for t in range(tokenizer.vocab_size)
    ]
    eos = tokenizer.eos_token_ids
    rng = random.Random(regex)
    for _ in range(6):  # walks through the language, each from the start
        constraint = constraints.new(constraints.compile(StructuredOutputsParams(regex=regex)))
        committed: list[int] = []
        while True:
            done = b"".join(surfaces[t] for t in committed)
            expected = np.zeros(tokenizer.vocab_size, dtype=bool)
            rest = [w[len(done) :] for w in language if w.startswith(done)]
            if backend == "llguidance" and len(rest) == 1 and rest[0]:
                expected[_continuation(tokenizer, rest[0].decode())[0]] = True
            else:
                for t, surface in enumerate(surfaces):
                    if surface and any(w.startswith(done + surface) for w in language):
                        expected[t] = True
            if done in language:
                expected[sorted(eos)] = True
            mask = constraint.mask()
            assert np.array_equal(mask, expected), sorted(np.flatnonzero(mask ^ expected))[:10]
            # the mask of a position after drafts is the mask after committing them
            choice = int(rng.choice(np.flatnonzero(expected)))
            if choice in eos:
                break
            assert np.array_equal(
                constraint.mask([choice]), _fresh_after(constraints, regex, [*committed, choice])
            )
            committed.append(choice)
            constraint.commit([choice])


def _continuation(tokenizer: Tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, SPMVocabTokenizer):
        return tokenizer.encode_continuation(text)
    return tokenizer.encode(text, add_special_tokens=False)


def _fresh_after(constraints: Constraints, regex: str, tokens: list[int]) -> np.ndarray:
    fresh = constraints.new(constraints.compile(StructuredOutputsParams(regex=regex)))
    fresh.commit(tokens)
    return fresh.mask()


def test_special_tokens_never_allowed_inside_a_constraint(smollm2_tokenizer: Tokenizer) -> None:
    constraints = _constraints(smollm2_tokenizer)
    constraint = constraints.new(constraints.compile(StructuredOutputsParams(json_object=True)))
    mask = constraint.mask()
    for token in smollm2_tokenizer.all_special_ids:
        assert not mask[token]
    assert constraint.valid_prefix(
        smollm2_tokenizer.encode('{"a": 1}', add_special_tokens=False)
    ) == len(smollm2_tokenizer.encode('{"a": 1}', add_special_tokens=False))
