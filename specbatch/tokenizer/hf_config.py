"""What a Hugging Face model directory says about its tokenizer besides the vocabulary.

``tokenizer_config.json`` names the BOS/EOS/PAD tokens, whether to add BOS/EOS, the chat template
and any added tokens; ``special_tokens_map.json`` is the older home of the token names;
``generation_config.json`` lists the ids that end generation; ``chat_template.jinja`` (or
``chat_template.json``) is where newer saves keep the template.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbatch.errors import ModelLoadError
from specbatch.tokenizer.base import SpecialTokens

_NAMES = ("bos", "eos", "pad")


@dataclass(frozen=True)
class AddedTokenEntry:
    """One entry of ``added_tokens_decoder``."""

    content: str
    special: bool


@dataclass(frozen=True)
class HFTokenizerConfig:
    """The tokenizer settings of a model directory; every field is optional in the files."""

    directory: Path
    token_names: dict[str, str] = field(default_factory=dict)  # "bos" -> "<s>"
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    generation_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)  # "eos" -> ids
    chat_template: str | None = None
    added_tokens: dict[int, AddedTokenEntry] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: Path) -> HFTokenizerConfig:
        config = _read_json(directory / "tokenizer_config.json")
        names = _read_json(directory / "special_tokens_map.json")
        names.update(config)
        token_names = {n: t for n in _NAMES if (t := _content(names.get(f"{n}_token")))}
        generation = _read_json(directory / "generation_config.json")
        generation_ids = {n: _ids(generation.get(f"{n}_token_id")) for n in _NAMES}
        added = {
            int(token_id): AddedTokenEntry(str(entry["content"]), bool(entry.get("special")))
            for token_id, entry in config.get("added_tokens_decoder", {}).items()
        }
        return cls(
            directory=directory,
            token_names=token_names,
            add_bos_token=_optional_bool(config.get("add_bos_token")),
            add_eos_token=_optional_bool(config.get("add_eos_token")),
            generation_ids=generation_ids,
            chat_template=_chat_template(directory, config),
            added_tokens=added,
        )

    def special_tokens(
        self,
        token_to_id: Callable[[str], int | None],
        defaults: SpecialTokens,
    ) -> SpecialTokens:
        """The special ids, from the files where they say, else from ``defaults``.

        ``defaults`` carries what the vocabulary file itself implies (the ids a SentencePiece
        model reserves, whether ``tokenizer.json``'s post-processor adds BOS).
        """
        found = {name: self._token_id(name, token_to_id) for name in _NAMES}
        fallback = {
            "bos": defaults.bos_token_id,
            "eos": defaults.eos_token_id,
            "pad": defaults.pad_token_id,
        }
        resolved = {
            name: found[name]
            if found[name] is not None
            else next(iter(self.generation_ids.get(name, ())), fallback[name])
            for name in _NAMES
        }
        return SpecialTokens(
            bos_token_id=resolved["bos"],
            eos_token_id=resolved["eos"],
            pad_token_id=resolved["pad"],
            end_token_ids=frozenset(self.generation_ids.get("eos", ())),
            add_bos=defaults.add_bos if self.add_bos_token is None else self.add_bos_token,
            add_eos=defaults.add_eos if self.add_eos_token is None else self.add_eos_token,
            chat_template=self.chat_template,
        )

    def _token_id(self, name: str, token_to_id: Callable[[str], int | None]) -> int | None:
        text = self.token_names.get(name)
        if text is None:
            return None
        token_id = token_to_id(text)
        if token_id is None:
            raise ModelLoadError(
                f"{self.directory}: the tokenizer configuration names {name}_token {text!r}, "
                "which is not in the vocabulary"
            )
        return token_id


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _content(value: Any) -> str | None:
    # Token names are saved either as plain strings or as serialised AddedToken objects.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def _optional_bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates; "default" is the one for plain chats
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None
