"""A request's constraint compiled for the model's tokenizer: the grammar text llguidance reads,
checked once per distinct constraint and cached by content.

Compiling is bounded: llguidance's own limits (``LIMITS``: lexer fuel and states, grammar size,
items per mask step) stop a pathological regex or grammar with an error instead of a hang or
an unbounded allocation, and every error becomes an ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance

from specbatch.errors import InvalidRequestError
from specbatch.sampling_params import StructuredOutputsParams
from specbatch.structured.shortest import shortest_output

# A compile past this wall-clock time is refused (llguidance's limits bound its work too; this
# bounds what the limits do not foresee, e.g. a machine under load)
COMPILE_SECONDS = 10.0
CACHE_SIZE = 256  # compiled constraints kept (distinct schemas, regexes, grammars)
# JSON as models write it (``{"a": 1, "b": 2}``), and no other whitespace: flexible whitespace
# lets a small model pad with newlines until max_tokens
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


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint's grammar, valid for the tokenizer it was checked with."""

    key: str  # sha256 of (kind, canonical spec)
    text: str  # what ``llguidance.LLMatcher`` reads
    min_tokens: int  # fewer output tokens than this cannot satisfy it (a lower bound)


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


class GrammarCache:
    """Checked grammars by content, the least recently used dropped past ``CACHE_SIZE``;
    safe to use from several threads (compilation runs off the event loop)."""

    def __init__(self, tokenizer: Any, max_token_chars: int) -> None:
        self.tokenizer = tokenizer  # an llguidance.LLTokenizer
        self.max_token_chars = max_token_chars  # the longest token's text
        self._grammars: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The checked grammar of ``params``; ``InvalidRequestError`` naming the field when it
        does not compile (a bad schema, regex or grammar, or one past the limits)."""
        key = hashlib.sha256(f"{params.kind}\0{params.spec}".encode()).hexdigest()
        with self._lock:
            cached = self._grammars.get(key)
            if cached is not None:
                self._grammars.move_to_end(key)
                return cached
        param = f"structured_outputs.{params.kind}"
        try:
            text = grammar_text(params)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{param} does not compile: {exc}", param) from None
        error, _warnings = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer, limits=parser_limits()
        )
        if error:
            raise InvalidRequestError(f"{param} does not compile: {_warnings[0]}", param)
        compiled = CompiledGrammar(key, text, self._min_tokens(params, text))
        with self._lock:
            self._grammars[key] = compiled
            while len(self._grammars) > CACHE_SIZE:
                self._grammars.popitem(last=False)
        return compiled

    def _min_tokens(self, params: StructuredOutputsParams, text: str) -> int:
        """The most of: the tokens the constraint forces first, and its shortest output in
        characters over the longest token's."""
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=parser_limits())
        forced = len(matcher.compute_ff_tokens())
        return max(forced, -(-shortest_output(params) // self.max_token_chars))
