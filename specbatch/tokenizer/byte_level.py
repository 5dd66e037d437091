"""Building a byte-level BPE tokenizer (GGUF ``gpt2`` vocabularies) on the ``tokenizers`` library.

A GGUF stores the vocabulary already spelled in GPT-2's byte alphabet, the merges as ``"a b"``
strings, and only the *name* of the pre-tokenizer (``tokenizer.ggml.pre``) that cuts text into
words before merging. The names map to the split regexes llama.cpp applies for them, in order;
each regex isolates its matches, and the gaps between matches stay pieces of their own.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from specbatch.tokenizer.spm_vocab import TokenType

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS = r"\p{N}"

_GPT2_SPLITS = (_GPT2,)
# StarCoder-family vocabularies (SmolLM among them) cut every digit apart before GPT-2's regex.
_DIGIT_SPLITS = (_DIGITS, _GPT2)
_LLAMA3_SPLITS = (_LLAMA3,)
_QWEN2_SPLITS = (_QWEN2,)

PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _GPT2_SPLITS,
    "gpt2": _GPT2_SPLITS,
    "gpt-2": _GPT2_SPLITS,
    "mpt": _GPT2_SPLITS,
    "olmo": _GPT2_SPLITS,
    "jais": _GPT2_SPLITS,
    "smollm": _DIGIT_SPLITS,
    "starcoder": _DIGIT_SPLITS,
    "refact": _DIGIT_SPLITS,
    "command-r": _DIGIT_SPLITS,
    "codeshell": _DIGIT_SPLITS,
    "exaone": _DIGIT_SPLITS,
    "minerva-7b": _DIGIT_SPLITS,
    "llama-bpe": _LLAMA3_SPLITS,
    "llama3": _LLAMA3_SPLITS,
    "llama-v3": _LLAMA3_SPLITS,
    "falcon3": _LLAMA3_SPLITS,
    "dbrx": _LLAMA3_SPLITS,
    "smaug-bpe": _LLAMA3_SPLITS,
    "qwen2": _QWEN2_SPLITS,
    "stablelm2": _QWEN2_SPLITS,
    "deepseek-r1-qwen": _QWEN2_SPLITS,
}
# Llama 3 takes a word that is itself a token whole, even where the merges would not reach it.
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3"})


def build_byte_level_bpe(
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: Sequence[str],
    pre: str,
    source: str,
) -> Backend:
    """A ``tokenizers`` BPE for a GGUF ``gpt2`` vocabulary; ids equal positions in ``tokens``.

    Control tokens are added as special tokens and user-defined ones as plain added tokens, so
    both are matched whole in text. An unknown ``pre`` falls back to GPT-2's regex, with a
    warning naming ``source``.
    """
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        warnings.warn(
            f"{source}: unknown tokenizer.ggml.pre {pre!r}; splitting words with GPT-2's regex, "
            "which may tokenize numbers and whitespace differently from the model's tokenizer",
            stacklevel=3,
        )
        splits = _GPT2_SPLITS
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _IGNORE_MERGES)
    backend = Backend(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    _add_whole_tokens(backend, tokens, token_types)
    return backend


def _add_whole_tokens(backend: Backend, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    # A token whose text is already in the vocabulary keeps its id when added; tokens stored as
    # raw text (outside the byte alphabet) decode to their raw bytes through the ByteLevel decoder.
    control, user_defined = [], []
    for token, kind in zip(tokens, token_types, strict=True):
        if not token:
            continue
        if kind == TokenType.CONTROL:
            control.append(AddedToken(token, special=True, normalized=False))
        elif kind == TokenType.USER_DEFINED:
            user_defined.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
