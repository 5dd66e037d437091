"""The engine's side of structured outputs: one grammar tokenizer and grammar cache per model,
and a constraint per sequence that asks for one."""

from __future__ import annotations

import threading
from typing import Any

from specbatch.sampling_params import StructuredOutputsParams
from specbatch.structured.bridge import grammar_tokenizer
from specbatch.structured.constraint import Constraint
from specbatch.structured.grammar import CompiledGrammar, GrammarCache
from specbatch.tokenizer import Tokenizer


class Constraints:
    """Compiles requests' constraints (checked when the request is made, cached by content)
    and makes each sequence's matcher. The grammar tokenizer (~0.4 s for a 49k vocabulary)
    is built at the first constrained request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size)
                self._cache = GrammarCache(tokenizer, self.tokenizer.max_token_chars)
            return self._cache

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The checked grammar (``InvalidRequestError`` naming the field if it is not one)."""
        return self.grammars.compile(params)

    def new(self, grammar: CompiledGrammar) -> Constraint:
        """A fresh matcher of ``grammar`` for one sequence."""
        tokenizer: Any = self.grammars.tokenizer
        return Constraint(tokenizer, grammar, self.vocab_size)
