"""Per-request generation settings, validated on construction (vLLM's ``SamplingParams``)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from specbatch.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's ``StructuredOutputsParams``): exactly
    one of ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (the output is
    one of these strings), ``grammar`` (a Lark grammar; llguidance's flavour, which also reads
    GBNF-like rules) or ``json_object=True`` (any JSON object). Every position the target
    scores is masked to the tokens the constraint allows, with speculation too (drafts are
    checked against the same constraint), and once the constraint is complete only the end of
    the sequence may follow.

    Sizes are bounded (``MAX_SPEC_CHARS`` of schema, regex or grammar text, ``MAX_CHOICES``
    choices of ``MAX_CHOICE_CHARS``); whether the constraint compiles is checked when the
    request is made, and an error names the field.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    MAX_SPEC_CHARS = 65_536
    MAX_CHOICES = 1024
    MAX_CHOICE_CHARS = 4096
    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [kind for kind in self.KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs takes exactly one of {list(self.KINDS)}, got "
                f"{given or 'none'}",
                "structured_outputs",
            )
        if self.json is not None:
            self._check_json()
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check_text(f"structured_outputs.{name}", value, self.MAX_SPEC_CHARS)
        if self.choice is not None:
            self._check_choice()
        if self.json_object is not None and self.json_object is not True:
            raise InvalidRequestError(
                f"structured_outputs.json_object must be true, got {self.json_object!r}",
                "structured_outputs.json_object",
            )

    def _check_json(self) -> None:
        param = "structured_outputs.json"
        schema = self.json
        if isinstance(schema, str):
            _check_text(param, schema, self.MAX_SPEC_CHARS)
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"{param} must be a JSON schema object, got {type(schema).__name__}", param
            )
        try:
            text = json.dumps(schema, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"{param} is not a JSON value: {exc}", param) from None
        _check_text(param, text, self.MAX_SPEC_CHARS)

    def _check_choice(self) -> None:
        param = "structured_outputs.choice"
        choice = self.choice
        if not isinstance(choice, list | tuple) or not choice:
            raise InvalidRequestError(f"{param} must be a non-empty list of strings", param)
        if len(choice) > self.MAX_CHOICES:
            raise InvalidRequestError(
                f"{param} has {len(choice)} entries, at most {self.MAX_CHOICES}", param
            )
        for entry in choice:
            _check_text(param, entry, self.MAX_CHOICE_CHARS)

    @property
    def kind(self) -> str:
        """Which of ``KINDS`` this constraint is."""
        return next(kind for kind in self.KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as canonical text (a schema's JSON with sorted keys, the choices as
        a JSON list): equal constraints have equal ``(kind, spec)``."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            return json.dumps(schema, sort_keys=True)
        if self.kind == "choice":
            return json.dumps(list(value))
        return "" if self.kind == "json_object" else str(value)


def check_text(text: str, param: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (JSON can carry a lone surrogate, which no
    tokenizer can encode), naming the field ``param``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
            f"character {exc.start}",
            param,
        ) from None


def _check_text(param: str, value: object, most: int) -> None:
    """A non-empty string of at most ``most`` characters, valid Unicode."""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string, got {value!r}", param)
    if len(value) > most:
        raise InvalidRequestError(f"{param} has {len(value)} characters, at most {most}", param)
    check_text(value, param)


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
    Every field is checked here; a bad value raises ``InvalidRequestError`` (a ``ValueError``)
    naming the field (its ``param``) and its range. Numbers must be finite; ``temperature`` and
    ``repetition_penalty`` are at most ``MAX_SCALE`` (beyond it every distribution is flat or
    one-hot anyway), ``repetition_penalty`` at least 0.01 (dividing logits by less overflows
    float32). Checks that need the model (token ids within its vocabulary, the context
    length) happen when the engine admits the request.
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
    structured_outputs: StructuredOutputsParams | None = None

    MAX_LOGPROBS = 20
    MAX_N = 128
    MAX_SCALE = 100.0

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
        _check_number("temperature", self.temperature, 0.0, self.MAX_SCALE)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, note="0 or -1 disables it")
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.01, self.MAX_SCALE)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), _INT64_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, self.MAX_LOGPROBS)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(
                "stop must be a non-empty string or a list of non-empty strings", "stop"
            )
        if self.stop and not self.detokenize:
            raise InvalidRequestError(
                "stop strings need detokenize=True (use stop_token_ids instead)", "stop"
            )
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, 0, what="token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias", token, 0, what="keys are token ids")
                _check_number("logit_bias", bias, -100.0, 100.0, what=f"value of {token}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidRequestError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}",
                "structured_outputs",
            )
        if not isinstance(self.output_kind, OutputKind):
            raise InvalidRequestError(
                f"output_kind must be one of {[k.value for k in OutputKind]}", "output_kind"
            )

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
    what: str = "",
) -> None:
    label = f"{name} ({what})" if what else name
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(float(value) if isinstance(value, float) else 0.0)
    ):
        raise InvalidRequestError(f"{label} must be a finite number, got {value!r}", name)
    assert isinstance(value, (int, float))
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        left = "(" if low_open else "["
        raise InvalidRequestError(
            f"{label} must be in {left}{'-inf' if low is None else low}, "
            f"{'inf' if high is None else high}], got {value}",
            name,
        )


def _check_int(
    name: str,
    value: object,
    low: int,
    high: int | None = None,
    note: str = "",
    what: str = "",
) -> None:
    """An integer in [low, high]; without ``high``, any up to int64 (what tensors hold)."""
    label = f"{name} ({what})" if what else name
    suffix = f" ({note})" if note else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{label} must be an integer, got {value!r}{suffix}", name)
    if high is None and value > _INT64_MAX:
        raise InvalidRequestError(
            f"{label} must be an integer below 2^63, got one of {_digits(value)} digits", name
        )
    if value < low or (high is not None and value > high):
        shown = value if abs(value) < 10**30 else f"one of {_digits(value)} digits"
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequestError(f"{label} must be {bounds}, got {shown}{suffix}", name)


def _digits(value: int) -> int:
    """Decimal digits of an integer; past what ``str()`` converts (4300 digits), estimated."""
    magnitude = abs(value)
    if magnitude.bit_length() < 14_000:
        return len(str(magnitude))
    return int(magnitude.bit_length() * math.log10(2)) + 1
