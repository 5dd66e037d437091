"""The tokenizer interface the engine uses, whatever file the vocabulary came from.

A concrete tokenizer only turns text into ids and back (`_encode_text`, `decode`); the special
ids, the BOS/EOS policy and the chat template are configuration, held here in `SpecialTokens`, so
every format adds BOS, reports end-of-generation ids and renders chats the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specbatch.errors import InvalidRequestError, ModelLoadError
from specbatch.sampling_params import check_text
from specbatch.tokenizer.chat_template import ChatTemplate


@dataclass(frozen=True)
class SpecialTokens:
    """The special ids and flags a model's tokenizer configuration names.

    ``end_token_ids`` are the ids besides ``eos_token_id`` that end generation (``<|eot_id|>``,
    ``<|eom_id|>``, the extra entries of ``generation_config.json``'s ``eos_token_id``).
    """

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    end_token_ids: frozenset[int] = frozenset()
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        extra = {self.eos_token_id} if self.eos_token_id is not None else set()
        return self.end_token_ids | extra

    def check(self, vocab_size: int, source: str) -> None:
        """Raise `ModelLoadError` naming ``source`` if an id lies outside the vocabulary."""
        named = [
            ("bos_token_id", self.bos_token_id),
            ("eos_token_id", self.eos_token_id),
            ("pad_token_id", self.pad_token_id),
            *(("an end-of-generation id", i) for i in sorted(self.end_token_ids)),
        ]
        for name, token_id in named:
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise ModelLoadError(
                    f"{source}: {name} is {token_id}, outside the vocabulary of {vocab_size} tokens"
                )


class Tokenizer(ABC):
    """Text to token ids and back, plus the model's special ids and chat template."""

    def __init__(self, special: SpecialTokens) -> None:
        self._special = special
        self._template: ChatTemplate | None = None
        self._max_token_chars: int | None = None

    @abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Ids of ``text`` alone: special-token text matched whole, no BOS/EOS added."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; ``skip_special_tokens`` drops the ids in `all_special_ids`."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry spelled exactly ``token``, or None."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, added tokens included; every id is below it."""

    @property
    @abstractmethod
    def all_special_ids(self) -> frozenset[int]:
        """The ids ``decode(..., skip_special_tokens=True)`` leaves out."""

    @property
    def provisional_ids(self) -> frozenset[int]:
        """Ids whose decoded text can still change with the ids that follow them.

        Hugging Face's ByteFallback decoder turns a whole run of ``<0xNN>`` pieces into U+FFFDs
        when the run is not valid UTF-8, so a streaming detokenizer must hold such a run back
        until it ends. Decoders that join all bytes first (byte-level BPE, `SPMVocab`) only
        ever change an incomplete last character, and need nothing here.
        """
        return frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        With ``add_special_tokens`` the BOS (and, rarely, EOS) id is added when the model's
        configuration asks for it. Text rendered by a chat template usually already starts with
        the BOS text, so encode it with ``add_special_tokens=False``.
        """
        check_text(text, "prompt")
        ids = self._encode_text(text)
        if add_special_tokens:
            if self._special.add_bos and self._special.bos_token_id is not None:
                ids.insert(0, self._special.bos_token_id)
            if self._special.add_eos and self._special.eos_token_id is not None:
                ids.append(self._special.eos_token_id)
        return ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The prompt text of a conversation rendered by the chat template, and its token ids
        (the template already holds any BOS text the model wants, so none is added)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return text, self.encode(text, add_special_tokens=False)

    @property
    def max_token_chars(self) -> int:
        """The most characters one token's text holds (bounds the tokens of a text from
        below without tokenizing it); computed once, on first use."""
        if self._max_token_chars is None:
            longest = max((len(self.decode([i])) for i in range(self.vocab_size)), default=1)
            self._max_token_chars = max(longest, 1)
        return self._max_token_chars

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, or None if the model names none."""
        return self._special.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id, or None; see `eos_token_ids` for all ids ending generation."""
        return self._special.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        """The padding id the model names, or None."""
        return self._special.pad_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: EOS plus the end-of-turn ids the configuration names."""
        return self._special.eos_token_ids

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode` puts BOS first when ``add_special_tokens`` is true."""
        return self._special.add_bos and self._special.bos_token_id is not None

    @property
    def chat_template(self) -> str | None:
        """The jinja2 chat template source, or None if the model has none."""
        return self._special.chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` as the model's jinja chat template renders it.

        ``bos_token`` and ``eos_token`` are available to the template; ``kwargs`` (``tools``,
        ``documents``, template options) are passed through and override them. Raises
        `InvalidRequestError` (a ``ValueError``) if the model has no chat template or the
        template rejects the messages, `ChatTemplateError` if the template itself is broken.
        ``messages`` is positional-only, so a template variable may be called anything (even
        ``self`` or ``messages``: the messages themselves cannot be overridden).
        """
        self._check_messages_text(messages)
        template = self.compiled_chat_template()
        if template is None:
            raise InvalidRequestError(
                "this model has no chat template (no tokenizer.chat_template in the GGUF, no "
                "chat_template in tokenizer_config.json or chat_template.jinja); send a plain "
                "prompt instead of chat messages",
                "messages",
            )
        variables = {
            "bos_token": self._token_text(self._special.bos_token_id),
            "eos_token": self._token_text(self._special.eos_token_id),
            **kwargs,
        }
        return template.render(messages, add_generation_prompt, **variables)

    def compiled_chat_template(self) -> ChatTemplate | None:
        """The compiled template (None without one); `ChatTemplateError` if it is broken."""
        if self._special.chat_template is None:
            return None
        if self._template is None:
            self._template = ChatTemplate(self._special.chat_template)
        return self._template

    @staticmethod
    def _check_messages_text(messages: list[dict[str, Any]]) -> None:
        for message in messages:
            if not isinstance(message, dict):
                continue  # the template's render reports it
            for key, value in message.items():
                if isinstance(value, str):
                    check_text(value, "messages")
                elif key == "content" and isinstance(value, list):
                    for part in value:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            check_text(part["text"], "messages")

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.decode([token_id])
