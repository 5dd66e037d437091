"""One sequence's constraint: an llguidance matcher advanced only by the tokens the sequence
commits, and the masks of the positions a step scores (the next token, and each draft's
position given the drafts before it) computed on copies, never on the matcher itself.

Masks are bit arrays over the model's vocabulary (``True``: allowed). Once the constraint is
complete only the end of the sequence is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np

from specbatch.structured.grammar import CompiledGrammar, parser_limits


class ConstraintError(RuntimeError):
    """The matcher refused a committed token or hit a limit (the step fails its request)."""


class Constraint:
    """A sequence's matcher and, until its next committed token, the masks asked of it."""

    def __init__(self, tokenizer: Any, grammar: CompiledGrammar, vocab_size: int) -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._matcher = llguidance.LLMatcher(
            tokenizer, grammar.text, log_level=0, limits=parser_limits()
        )
        self._check(self._matcher)
        self._masks: dict[tuple[int, ...], np.ndarray] = {}

    def fork(self) -> Constraint:
        """A copy with the same committed tokens (another of the request's completions)."""
        twin = object.__new__(Constraint)
        twin.grammar, twin.vocab_size = self.grammar, self.vocab_size
        twin._tokenizer = self._tokenizer
        twin._matcher = self._matcher.deep_copy()
        twin._masks = {}
        return twin

    def restart(self, tokens: Sequence[int]) -> None:
        """Back to the constraint's start, then ``tokens`` (a preempted sequence's output,
        recomputed)."""
        self._matcher.reset()
        self._masks.clear()
        self.commit(tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        """The sequence emitted ``tokens``: every one was allowed by the mask it was drawn
        under, so a refusal is a bug or a limit, raised."""
        if not tokens:
            return
        self._masks.clear()
        if not self._matcher.consume_tokens(list(tokens)):
            raise ConstraintError(f"the constraint refused a committed token: {self._error()}")

    @property
    def done(self) -> bool:
        """Whether the constraint is complete: only the end of the sequence may follow."""
        return bool(self._matcher.is_stopped())

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts``, in order, the constraint allows after the committed tokens."""
        return int(self._matcher.validate_tokens(list(drafts))) if drafts else 0

    def forced(self) -> list[int]:
        """The tokens the constraint allows as its only continuation, in order (none when it
        allows a choice)."""
        return list(self._matcher.compute_ff_tokens())

    def mask(self, drafts: Sequence[int] = ()) -> np.ndarray:
        """``[vocab]`` bool: the tokens allowed after the committed tokens and ``drafts``.

        Past a draft the constraint refuses, every token: such a row is never emitted (the
        refused draft is rejected, the target giving it probability 0), and the verify only
        needs it to exist."""
        key = tuple(drafts)
        cached = self._masks.get(key)
        if cached is not None:
            return cached
        matcher = self._matcher
        if key:
            matcher = matcher.deep_copy()
            if not matcher.consume_tokens(list(key)):
                mask = self._masks[key] = np.ones(self.vocab_size, dtype=bool)
                return mask
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        self._check(matcher)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if len(mask) < self.vocab_size:  # logits past the tokenizer's ids: never allowed
            mask = np.pad(mask, (0, self.vocab_size - len(mask)))
        self._masks[key] = mask
        return mask

    def _check(self, matcher: Any) -> None:
        if matcher.is_error():
            raise ConstraintError(self._error(matcher))

    def _error(self, matcher: Any = None) -> str:
        return str((matcher or self._matcher).get_error())
