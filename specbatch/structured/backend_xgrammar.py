"""The xgrammar backend (optional: ``pip install 'specbatch[xgrammar]'``, then
``EngineConfig.structured_outputs_backend="xgrammar"``).

The vocabulary is handed over as every token's bytes (the bytes llguidance's bridge reads,
special tokens as none), so both backends see the same tokens. JSON is written as with
llguidance (``", "`` and ``": "``, no other whitespace); ``grammar`` is Lark here too
(xgrammar's Lark reader). Its matcher does not restrict a forced stretch to the canonical
tokenization as llguidance does, so a forced draft may be rejected where the target prefers
another spelling of the same text: still exact, a little less free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from specbatch.errors import ConfigError
from specbatch.sampling_params import StructuredOutputsParams
from specbatch.structured.bridge import grammar_tokenizer
from specbatch.tokenizer import Tokenizer


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ConfigError(
            "structured_outputs_backend='xgrammar' needs xgrammar: pip install "
            "'specbatch[xgrammar]' (or use the default, llguidance)"
        ) from None
    return xgrammar


class XGrammarMatcher:
    """``backend.Matcher`` over an ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        words = -(-vocab_size // 32)
        self._bits = np.zeros((1, words), dtype=np.int32)
        self._failed: str | None = None

    def consume(self, tokens: Sequence[int]) -> bool:
        for done, token in enumerate(tokens):
            if not self._matcher.accept_token(int(token)):
                self._matcher.rollback(done)
                self._failed = f"token {token} refused"
                return False
        return True

    def validate(self, tokens: Sequence[int]) -> int:
        count = 0
        for token in tokens:
            if not self._matcher.accept_token(int(token)):
                break
            count += 1
        if count:
            self._matcher.rollback(count)
        return count

    def rollback(self, count: int) -> None:
        if count:
            self._matcher.rollback(count)

    def bitmask(self) -> np.ndarray:
        if self._matcher.is_terminated():  # past the end (an EOS among drafts): only the end
            allowed = np.zeros(self._bits.size * 32, dtype=bool)
            allowed[list(self._matcher.stop_token_ids)] = True
            return np.packbits(allowed, bitorder="little")
        self._matcher.fill_next_token_bitmask(self._bits, 0)
        return self._bits[0].view(np.uint8).copy()

    def forced(self) -> list[int]:
        return [int(t) for t in self._matcher.find_jump_forward_tokens()]

    def stopped(self) -> bool:
        return bool(self._matcher.is_terminated())

    def error(self) -> str | None:
        return self._failed


class XGrammarBackend:
    """``backend.Backend`` for xgrammar: a compiled constraint is its ``CompiledGrammar``."""

    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        xgr = _xgrammar()
        bridge = grammar_tokenizer(tokenizer, vocab_size)
        self.end_tokens = list(bridge.eos_tokens)
        vocab = [
            b"" if bridge.is_special_token(t) else bridge.decode_bytes([t])
            for t in range(vocab_size)
        ]
        info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=self.end_tokens
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind, value = params.kind, getattr(params, params.kind)
        compiler = self._compiler
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else value
                text = schema if isinstance(schema, str) else json.dumps(schema)
                return compiler.compile_json_schema(
                    text, any_whitespace=False, separators=(", ", ": "), strict_mode=True
                )
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":
                rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
                return compiler.compile_grammar(f"root ::= {rule}")
            return compiler.compile_lark(value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(
                str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid"
            ) from None

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        xgr = _xgrammar()
        return XGrammarMatcher(xgr.GrammarMatcher(compiled), self.vocab_size)
