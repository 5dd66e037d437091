"""Per-request generation settings, validated on construction (vLLM's ``SamplingParams``)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


class OutputKind(enum.Enum):
    """What each step reports for a request: everything so far, only the new part, or the end."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """How to sample one request's completion(s).

    ``temperature == 0`` is greedy decoding. ``top_k == 0`` (or ``-1``, vLLM's older spelling)
    keeps every token. Penalties follow vLLM/OpenAI: ``repetition_penalty`` divides the positive
    logits (multiplies the negative ones) of every token seen in the prompt or output;
    ``presence_penalty`` and ``frequency_penalty`` subtract from output tokens' logits;
    ``logit_bias`` adds a value in [-100, 100] to given token ids' logits. Logprobs are
    those of the raw model distribution (before temperature, penalties and truncation).
    ``detokenize=False`` skips all text work (outputs carry token ids only, ``text`` stays empty
    and logprob entries have no ``decoded_token``); it cannot be combined with ``stop`` strings.
    Every field is checked here; a bad value raises ``ValueError`` naming the field and its range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE

    MAX_LOGPROBS = 20
    MAX_N = 128

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, 1, self.MAX_N)
        _check_number("temperature", self.temperature, 0.0, None)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, None, note="0 or -1 disables it")
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, self.MAX_LOGPROBS)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (use stop_token_ids instead)")
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative token ids")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
                _check_number(f"logit_bias[{token}]", bias, -100.0, 100.0)
        if not isinstance(self.output_kind, OutputKind):
            raise ValueError(f"output_kind must be one of {[k.value for k in OutputKind]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether this request's distribution depends on its history."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _check_number(
    name: str,
    value: object,
    low: float | None,
    high: float | None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        left = "(" if low_open else "["
        raise ValueError(
            f"{name} must be in {left}{'-inf' if low is None else low}, "
            f"{'inf' if high is None else high}], got {value}"
        )


def _check_int(name: str, value: object, low: int | None, high: int | None, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        suffix = f" ({note})" if note else ""
        raise ValueError(
            f"{name} must be in [{'-inf' if low is None else low}, "
            f"{'inf' if high is None else high}], got {value}{suffix}"
        )
