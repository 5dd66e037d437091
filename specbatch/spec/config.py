"""Speculative decoding configuration (vLLM's ``speculative_config`` shape)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from specbatch.errors import ConfigError

METHODS = ("draft_model", "ngram", "external")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft tokens for every decoding sequence.

    ``method``: ``"draft_model"`` (a smaller model of the same vocabulary, ``model``) or
    ``"ngram"`` (prompt lookup: the longest suffix n-gram, ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens, found earlier in the sequence proposes what followed it).
    ``num_speculative_tokens`` is k, the drafts verified per step (fewer near ``max_tokens`` or
    the context end). ``"external"`` means the application passes its own
    :class:`~specbatch.spec.proposer.Proposer` to ``LLMEngine(config, proposer=...)``.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    MAX_TOKENS = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative_config method must be one of {METHODS}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.MAX_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be an integer in [1, {self.MAX_TOKENS}], got {k!r}"
            )
        if self.method == "ngram":
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
                raise ConfigError(
                    "prompt_lookup_min and prompt_lookup_max must be integers with "
                    f"1 <= prompt_lookup_min <= prompt_lookup_max, got {low!r}, {high!r}"
                )
            if self.model is not None:
                raise ConfigError("speculative_config 'model' is for method 'draft_model'")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """Accept a config, a vLLM-style dict, or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ConfigError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)
