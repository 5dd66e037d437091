"""The tokenizer embedded in a GGUF file's metadata.

``tokenizer.ggml.model`` says which kind: ``gpt2`` is byte-level BPE (tokens, merges, and a
pre-tokenizer named by ``tokenizer.ggml.pre``), ``llama`` is SentencePiece BPE (tokens, scores,
``<0xNN>`` byte tokens). Token kinds (``token_type``) mark control and user-defined tokens, which
are matched whole in text. Where a flag is missing the defaults are llama.cpp's: SentencePiece
vocabularies add BOS and a leading space, byte-level ones do neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specbatch.errors import ModelLoadError
from specbatch.tokenizer.base import SpecialTokens, Tokenizer
from specbatch.tokenizer.byte_level import build_byte_level_bpe
from specbatch.tokenizer.hf_tokenizer import HFTokenizer
from specbatch.tokenizer.spm_tokenizer import SPMTokenizer
from specbatch.tokenizer.spm_vocab import SPMVocab, TokenType

_PREFIX = "tokenizer.ggml."
SUPPORTED_MODELS = ("gpt2", "llama")


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer a GGUF file describes; `ModelLoadError` naming ``path`` if it has none."""
    # Imported here: the models package imports torch, which tokenizer users need not pay for.
    from specbatch.models.gguf_file import GGUFFile

    with GGUFFile(path) as gguf_file:
        metadata = gguf_file.metadata
    kind = metadata.get(_PREFIX + "model")
    tokens = metadata.get(_PREFIX + "tokens")
    if kind is None or not tokens:
        raise ModelLoadError(
            f"{path}: the GGUF file carries no tokenizer (no tokenizer.ggml.model and "
            "tokenizer.ggml.tokens metadata); load the tokenizer from the original model's "
            "directory (tokenizer.json or tokenizer.model) instead"
        )
    if kind not in SUPPORTED_MODELS:
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.model is {kind!r}; specbatch reads 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece) vocabularies"
        )
    types = _array(metadata, "token_type", len(tokens), path)
    if types is None:
        types = [TokenType.NORMAL] * len(tokens)
    special = _special_tokens(metadata, kind, len(tokens))
    tokenizer = _build(path, metadata, kind, tokens, types, special)
    special.check(tokenizer.vocab_size, str(path))
    return tokenizer


def _build(
    path: Path,
    metadata: dict[str, Any],
    kind: str,
    tokens: list[str],
    types: list[int],
    special: SpecialTokens,
) -> Tokenizer:
    if kind == "gpt2":
        merges = _array(metadata, "merges", None, path)
        if merges is None:
            raise ModelLoadError(f"{path}: byte-level vocabulary without tokenizer.ggml.merges")
        pre = str(metadata.get(_PREFIX + "pre", "default"))
        return HFTokenizer(build_byte_level_bpe(tokens, types, merges, pre, str(path)), special)
    scores = _array(metadata, "scores", len(tokens), path)
    if scores is None:
        raise ModelLoadError(f"{path}: SentencePiece vocabulary without tokenizer.ggml.scores")
    try:
        vocab = SPMVocab(
            pieces=tuple(tokens),
            scores=tuple(float(s) for s in scores),
            types=tuple(int(t) for t in types),
            add_space_prefix=bool(metadata.get(_PREFIX + "add_space_prefix", True)),
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    return SPMTokenizer(vocab, special)


def _array(metadata: dict[str, Any], key: str, length: int | None, path: Path) -> list[Any] | None:
    value = metadata.get(_PREFIX + key)
    if value is None:
        return None
    if not isinstance(value, list) or (length is not None and len(value) != length):
        size = len(value) if isinstance(value, list) else type(value).__name__
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.{key} should list one entry per token ({length}), got {size}"
        )
    return value


def _special_tokens(metadata: dict[str, Any], kind: str, size: int) -> SpecialTokens:
    def token_id(key: str) -> int | None:
        value = metadata.get(_PREFIX + key)
        return None if value is None else int(value)

    pad = token_id("padding_token_id")
    ends = {token_id("eot_token_id"), token_id("eom_token_id")}
    return SpecialTokens(
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        # Some converters write -1 or 2**32-1 for "no padding token".
        pad_token_id=pad if pad is not None and 0 <= pad < size else None,
        end_token_ids=frozenset(i for i in ends if i is not None),
        add_bos=bool(metadata.get(_PREFIX + "add_bos_token", kind == "llama")),
        add_eos=bool(metadata.get(_PREFIX + "add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
