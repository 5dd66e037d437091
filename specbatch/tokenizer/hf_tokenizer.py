"""A tokenizer backed by the ``tokenizers`` library: ``tokenizer.json`` directories, and the
byte-level BPE that `byte_level` builds from a GGUF vocabulary."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from specbatch.errors import ModelLoadError
from specbatch.tokenizer.base import SpecialTokens, Tokenizer
from specbatch.tokenizer.hf_config import HFTokenizerConfig

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class HFTokenizer(Tokenizer):
    """Wraps a ``tokenizers.Tokenizer``; added tokens marked special are the special ids."""

    def __init__(self, backend: Backend, special: SpecialTokens) -> None:
        super().__init__(special)
        # BOS/EOS come from `special`, never from the backend's post-processor, so every
        # tokenizer format adds them by the same rule; padding and truncation are the engine's.
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._provisional = _byte_fallback_ids(backend)

    @classmethod
    def from_directory(cls, directory: Path) -> HFTokenizer:
        """Load ``directory/tokenizer.json`` and the configuration files next to it."""
        path = directory / "tokenizer.json"
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on malformed files
            raise ModelLoadError(
                f"{path}: cannot load it with the tokenizers library: {exc}"
            ) from None
        config = HFTokenizerConfig.read(directory)
        special = config.special_tokens(backend.token_to_id, SpecialTokens())
        adds_bos, adds_eos = _post_processor_adds(backend, special)
        special = replace(
            special,
            add_bos=adds_bos if config.add_bos_token is None else config.add_bos_token,
            add_eos=adds_eos if config.add_eos_token is None else config.add_eos_token,
        )
        tokenizer = cls(backend, special)
        special.check(tokenizer.vocab_size, str(directory))
        return tokenizer

    def _encode_text(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        id_list = list(ids)
        for token_id in id_list:
            if not 0 <= token_id < self._size:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary of {self._size} tokens"
                )
        return self._backend.decode(id_list, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def backend_json(self) -> str:
        """The ``tokenizers`` library's serialisation of this tokenizer (what grammar engines
        such as llguidance read)."""
        return str(self._backend.to_str())

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def provisional_ids(self) -> frozenset[int]:
        return self._provisional


def _byte_fallback_ids(backend: Backend) -> frozenset[int]:
    decoder = backend.decoder
    if decoder is None or not _uses_byte_fallback(json.loads(decoder.__getstate__())):
        return frozenset()
    vocab = backend.get_vocab(with_added_tokens=False)
    return frozenset(i for token, i in vocab.items() if _BYTE_PIECE.fullmatch(token))


def _uses_byte_fallback(decoder: Any) -> bool:
    if isinstance(decoder, dict):
        return decoder.get("type") == "ByteFallback" or any(
            _uses_byte_fallback(v) for v in decoder.values()
        )
    return isinstance(decoder, list) and any(_uses_byte_fallback(d) for d in decoder)


def _post_processor_adds(backend: Backend, special: SpecialTokens) -> tuple[bool, bool]:
    # Without add_bos_token/add_eos_token in tokenizer_config.json, tokenizer.json's
    # post-processor decides (Llama 3 adds <|begin_of_text|> there); ask it on a probe text.
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    bos, eos = special.bos_token_id, special.eos_token_id
    adds_bos = bos is not None and full[:1] == [bos] and plain[:1] != [bos]
    adds_eos = eos is not None and full[-1:] == [eos] and plain[-1:] != [eos]
    return adds_bos, adds_eos
