"""What the engine needs of a grammar engine: compile a constraint for the model's tokenizer,
and per sequence a matcher it advances, asks masks of, and rolls drafts back on.

Two backends: llguidance (the default; ``backend_llguidance``) and xgrammar (optional, used
when installed and asked for: ``EngineConfig.structured_outputs_backend="xgrammar"``;
``backend_xgrammar``). Both read the same ``StructuredOutputsParams``: a JSON schema, a regex,
choices, a Lark grammar, or any JSON object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from specbatch.sampling_params import StructuredOutputsParams


class Matcher(Protocol):
    """One sequence's position in a compiled constraint."""

    def consume(self, tokens: Sequence[int]) -> bool:
        """Advance by ``tokens``; False (and the matcher failed) if one is refused."""
        ...

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, are allowed next (the matcher does not move)."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` consumed tokens."""
        ...

    def bitmask(self) -> np.ndarray:
        """The allowed next tokens, packed: uint8, bit ``t % 8`` of byte ``t // 8``."""
        ...

    def forced(self) -> list[int]:
        """The tokens of the only continuation the constraint allows from here (canonical
        tokenization; empty where it allows a choice)."""
        ...

    def stopped(self) -> bool:
        """Whether only the end of the sequence may follow."""
        ...

    def error(self) -> str | None:
        """Why the matcher failed, or None."""
        ...


class Backend(Protocol):
    """A grammar engine set up for one model's tokenizer and vocabulary."""

    name: str
    end_tokens: list[int]  # what ends a sequence (allowed once the constraint is complete)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The backend's compiled form of ``params``; ``ValueError`` with the reason when it
        does not compile."""
        ...

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of ``compiled``."""
        ...
