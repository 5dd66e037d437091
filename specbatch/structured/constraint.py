"""One sequence's constraint: a backend's matcher advanced only by the tokens the sequence
commits, and the masks of the positions a step scores (the next token, and each draft's
position given the drafts before it), the drafts consumed and rolled back around each.

Masks are bool arrays over the model's vocabulary (``True``: allowed). Once the constraint is
complete only the end of the sequence is allowed. Each of a request's ``n`` sequences has its
own matcher; a preempted sequence keeps its tokens (its cache is recomputed, not its output),
so its matcher stands as it was.

A matcher that fails (the backend hits a limit, or one mask takes more CPU time than
``MASK_SECONDS``: an ambiguous grammar slowing down as its input grows) does not fail the
step: the constraint records ``error`` and allows only the end of the sequence from then on,
and the engine ends that request alone with the error.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import numpy as np

from specbatch.structured.backend import Matcher
from specbatch.structured.grammar import CompiledGrammar

# One mask past this fails its request: llguidance's masks take ~50 us (p50) and a few ms at
# worst on ordinary grammars, and every sequence of the batch waits on each one (a bound, not
# a tuning: a grammar 100x slower than the worst ordinary mask is the request's fault). The
# step thread's CPU seconds, not wall time: a loaded machine's waits are nobody's fault (CI saw
# a mask "take" 305 ms of wall time under load). The collector is paused while a mask is
# timed: a full collection of a large heap costs the thread 0.3-0.6 s of CPU when it happens
# to start inside the mask (CI failed a request on a 355 ms "mask" that way).
MASK_SECONDS = 0.1


class Constraint:
    """A sequence's matcher and, until its next committed token, the masks asked of it."""

    def __init__(
        self, matcher: Matcher, grammar: CompiledGrammar, vocab_size: int, end: Sequence[int]
    ) -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.error: str | None = None  # why the matcher failed (the request ends with it)
        self._matcher = matcher
        self._end = np.zeros(vocab_size, dtype=bool)
        self._end[[t for t in end if t < vocab_size]] = True
        self._masks: dict[tuple[int, ...], np.ndarray] = {}
        self._check()

    def commit(self, tokens: Sequence[int]) -> None:
        """The sequence emitted ``tokens``, each allowed by the mask it was drawn under (so
        a refusal is a failure of the matcher)."""
        if not tokens or self.error is not None:
            return
        self._masks.clear()
        if not self._matcher.consume(tokens):
            self._fail(f"the constraint refused the token it allowed: {self._reason()}")

    @property
    def done(self) -> bool:
        """Whether the constraint is complete: only the end of the sequence may follow."""
        return self.error is not None or self._matcher.stopped()

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts``, in order, the constraint allows after the committed tokens."""
        if not drafts or self.error is not None:
            return 0
        return self._matcher.validate(drafts)

    def forced(self) -> list[int]:
        """The tokens the constraint allows as its only continuation, in order (none when it
        allows a choice)."""
        if self.error is not None:
            return []
        return self._matcher.forced()

    def mask(self, drafts: Sequence[int] = ()) -> np.ndarray:
        """``[vocab]`` bool: the tokens allowed after the committed tokens and ``drafts``.

        Past a draft the constraint refuses, every token: such a row is never emitted (the
        refused draft is rejected, the target giving it probability 0), and the verify only
        needs it to exist."""
        if self.error is not None:
            return self._end
        key = tuple(drafts)
        cached = self._masks.get(key)
        if cached is not None:
            return cached
        matcher = self._matcher
        if key and matcher.validate(key) < len(key):
            mask = self._masks[key] = np.ones(self.vocab_size, dtype=bool)
            return mask
        collecting = gc.isenabled()
        gc.disable()  # the backend's time, not a collection's that starts inside it
        started = time.thread_time()  # CPU time: a loaded machine's waits do not count
        bits = None
        try:
            if key:
                matcher.consume(key)
            bits = matcher.bitmask()
            self._check()
        except Exception as exc:  # the backend's own failure: this request's, not the step's
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            if key:
                matcher.rollback(len(key))
            seconds = time.thread_time() - started
            if collecting:
                gc.enable()
        if seconds > MASK_SECONDS:
            self._fail(
                f"the constraint took {seconds * 1e3:.0f} ms for one token's mask (at most "
                f"{MASK_SECONDS * 1e3:.0f} ms: is the grammar ambiguous?)"
            )
        if self.error is not None or bits is None:
            return self._end
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if len(mask) < self.vocab_size:  # logits past the tokenizer's ids: never allowed
            mask = np.pad(mask, (0, self.vocab_size - len(mask)))
        self._masks[key] = mask
        return mask

    def _check(self) -> None:
        reason = self._matcher.error()
        if reason is not None:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        self._masks.clear()

    def _reason(self) -> str:
        return self._matcher.error() or "no reason given"
