"""A request's constraint compiled for the model's tokenizer by the engine's backend, once per
distinct constraint, cached by content; every failure an ``InvalidRequestError`` naming the
field.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from specbatch.errors import InvalidRequestError
from specbatch.sampling_params import StructuredOutputsParams
from specbatch.structured.backend import Backend
from specbatch.structured.shortest import shortest_output

# A compile past this wall-clock time is refused (llguidance's limits bound its work too; this
# bounds what the limits do not foresee, e.g. a machine under load)
COMPILE_SECONDS = 10.0
CACHE_SIZE = 256  # compiled constraints kept (distinct schemas, regexes, grammars)


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled by a backend for the tokenizer it was set up with."""

    key: str  # sha256 of (kind, canonical spec)
    compiled: Any  # the backend's form (llguidance: grammar text; xgrammar: CompiledGrammar)
    min_tokens: int  # fewer output tokens than this cannot satisfy it (a lower bound)


class GrammarCache:
    """Compiled constraints by content, the least recently used dropped past ``CACHE_SIZE``;
    safe to use from several threads (compilation runs off the event loop)."""

    def __init__(self, backend: Backend, max_token_chars: int) -> None:
        self.backend = backend
        self.max_token_chars = max_token_chars  # the longest token's text
        self._grammars: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled ``params``; ``InvalidRequestError`` naming the field when it does not
        compile (a bad schema, regex or grammar, or one past the backend's limits)."""
        key = hashlib.sha256(f"{params.kind}\0{params.spec}".encode()).hexdigest()
        with self._lock:
            cached = self._grammars.get(key)
            if cached is not None:
                self._grammars.move_to_end(key)
                return cached
        param = f"structured_outputs.{params.kind}"
        try:
            compiled = self.backend.compile(params)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"{param} does not compile: {exc}", param) from None
        made = CompiledGrammar(key, compiled, self._min_tokens(params, compiled))
        with self._lock:
            self._grammars[key] = made
            while len(self._grammars) > CACHE_SIZE:
                self._grammars.popitem(last=False)
        return made

    def _min_tokens(self, params: StructuredOutputsParams, compiled: Any) -> int:
        """The most of: the tokens the constraint forces first, and its shortest output in
        characters over the longest token's."""
        forced = len(self.backend.matcher(compiled).forced())
        return max(forced, -(-shortest_output(params) // self.max_token_chars))
