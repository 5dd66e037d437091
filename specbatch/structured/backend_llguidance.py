"""The llguidance backend: constraints as llguidance grammars, checked under bounded work.

Compiling is bounded: llguidance's own limits (``parser_limits``: lexer fuel and states,
grammar size, items per mask step) stop a pathological regex or grammar with an error instead
of a hang or an unbounded allocation. JSON is written as models write it (``", "`` and
``": "``) with no other whitespace: flexible whitespace lets a small model pad with newlines
until ``max_tokens``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np

from specbatch.sampling_params import StructuredOutputsParams
from specbatch.structured.bridge import grammar_tokenizer
from specbatch.tokenizer import Tokenizer

JSON_STYLE: Any = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits, halved where they bound one request's work: a mask step at most
    ~7 ms of lexing (14k fuel/ms) and ~1 ms of parsing, a lexer of at most 100k states
    (~1-2 kB each), a grammar of at most 250k symbols."""
    return llguidance.LLParserLimits(
        step_lexer_fuel=100_000,
        step_max_items=25_000,
        max_lexer_states=100_000,
        max_grammar_size=250_000,
        verbose_errors=False,
    )


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    kind, value = params.kind, getattr(params, params.kind)
    matcher = llguidance.LLMatcher
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        schema = json.loads(schema) if isinstance(schema, str) else schema
        return matcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    if kind == "regex":
        return matcher.grammar_from_regex(value)
    if kind == "choice":
        return matcher.grammar_from_regex("|".join(re.escape(choice) for choice in value))
    return matcher.grammar_from_lark(value)


class LLGuidanceMatcher:
    """``backend.Matcher`` over an ``llguidance.LLMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def consume(self, tokens: Sequence[int]) -> bool:
        return bool(self._matcher.consume_tokens(list(tokens)))

    def validate(self, tokens: Sequence[int]) -> int:
        return int(self._matcher.validate_tokens(list(tokens)))

    def rollback(self, count: int) -> None:
        self._matcher.rollback(count)

    def bitmask(self) -> np.ndarray:
        return np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)

    def forced(self) -> list[int]:
        return list(self._matcher.compute_ff_tokens())

    def stopped(self) -> bool:
        return bool(self._matcher.is_stopped())

    def error(self) -> str | None:
        return str(self._matcher.get_error()) if self._matcher.is_error() else None


class LLGuidanceBackend:
    """``backend.Backend`` for llguidance: a compiled constraint is its checked grammar text."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = grammar_tokenizer(tokenizer, vocab_size)
        self.end_tokens = list(self.tokenizer.eos_tokens)

    def compile(self, params: StructuredOutputsParams) -> str:
        try:
            text = grammar_text(params)
        except (ValueError, TypeError) as exc:
            raise ValueError(str(exc)) from None
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer, limits=parser_limits()
        )
        if error:
            raise ValueError(messages[0])
        return text

    def matcher(self, compiled: str) -> LLGuidanceMatcher:
        made = llguidance.LLMatcher(self.tokenizer, compiled, log_level=0, limits=parser_limits())
        return LLGuidanceMatcher(made)
