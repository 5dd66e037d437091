"""The engine's side of structured outputs: one backend and grammar cache per model, and a
constraint per sequence that asks for one."""

from __future__ import annotations

import threading

from specbatch.errors import ConfigError
from specbatch.sampling_params import StructuredOutputsParams
from specbatch.structured.backend import Backend
from specbatch.structured.constraint import Constraint
from specbatch.structured.grammar import CompiledGrammar, GrammarCache
from specbatch.tokenizer import Tokenizer

BACKENDS = ("llguidance", "xgrammar")


def make_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> Backend:
    """The named backend set up for ``tokenizer``; ``ConfigError`` for an unknown name or a
    backend that is not installed."""
    if name == "llguidance":
        from specbatch.structured.backend_llguidance import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size)
    if name == "xgrammar":
        from specbatch.structured.backend_xgrammar import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size)
    raise ConfigError(f"structured_outputs_backend must be one of {list(BACKENDS)}, got {name!r}")


class Constraints:
    """Compiles requests' constraints (checked when the request is made, cached by content)
    and makes each sequence's matcher. The backend (~0.4 s to read a 49k vocabulary) is set
    up at the first constrained request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, backend: str = "llguidance") -> None:
        if backend not in BACKENDS:
            raise ConfigError(
                f"structured_outputs_backend must be one of {list(BACKENDS)}, got {backend!r}"
            )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.backend_name = backend
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                backend = make_backend(self.backend_name, self.tokenizer, self.vocab_size)
                self._cache = GrammarCache(backend, self.tokenizer.max_token_chars)
            return self._cache

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint (``InvalidRequestError`` naming the field if it is not one)."""
        return self.grammars.compile(params)

    def new(self, grammar: CompiledGrammar) -> Constraint:
        """A fresh matcher of ``grammar`` for one sequence."""
        backend = self.grammars.backend
        return Constraint(
            backend.matcher(grammar.compiled), grammar, self.vocab_size, backend.end_tokens
        )
