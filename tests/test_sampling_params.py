"""Every invalid SamplingParams field raises InvalidRequestError (a ValueError) naming the field
(in its message and as its ``param``) and its range."""

from __future__ import annotations

from typing import Any

import pytest

from specbatch import SamplingParams
from specbatch.errors import InvalidRequestError

INVALID: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -0.1}, r"temperature must be in \[0.0, 100.0\], got -0.1"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"temperature": "0.5"}, "temperature must be a finite number"),
    ({"temperature": True}, "temperature must be a finite number"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": 1e39}, r"temperature must be in \[0.0, 100.0\]"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
    ({"repetition_penalty": 1e39}, r"repetition_penalty must be in \[0.01, 100.0\]"),
    ({"repetition_penalty": 1e-50}, r"repetition_penalty must be in \[0.01, 100.0\]"),
    (
        {"max_tokens": 10**5000},
        "max_tokens must be an integer below 2\\^63, got one of 5001 digits",
    ),
    ({"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0.0, 1.0\]"),
    ({"top_k": -2}, r"top_k must be >= 0, got -2 \(0 or -1 disables it\)"),
    ({"top_k": 2**63}, "top_k must be an integer below 2\\^63, got one of 19 digits"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"min_p": 1.1}, r"min_p must be in \[0.0, 1.0\]"),
    ({"n": 0}, r"n must be in \[1, 128\], got 0"),
    ({"n": 1000}, r"n must be in \[1, 128\]"),
    ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
    ({"max_tokens": -5}, r"max_tokens must be >= 1"),
    ({"min_tokens": 5, "max_tokens": 3}, r"min_tokens must be in \[0, 3\], got 5"),
    ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2.0, 2.0\]"),
    ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2.0, 2.0\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[0.01, 100.0\]"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
    ({"prompt_logprobs": -1}, r"prompt_logprobs must be in \[0, 20\]"),
    ({"seed": "x"}, "seed must be an integer"),
    ({"seed": True}, "seed must be an integer"),
    ({"stop": [""]}, "stop must be a non-empty string"),
    ({"stop": [3]}, "stop must be a non-empty string"),
    ({"stop_token_ids": [-1]}, r"stop_token_ids \(token ids\) must be >= 0"),
    ({"stop_token_ids": [2**63]}, r"stop_token_ids \(token ids\) must be an integer below"),
    ({"output_kind": "delta"}, "output_kind must be one of"),
    ({"logit_bias": {5: 101.0}}, r"logit_bias \(value of 5\) must be in \[-100.0, 100.0\]"),
    ({"logit_bias": {5: float("inf")}}, r"logit_bias \(value of 5\) must be a finite number"),
    ({"logit_bias": {-1: 1.0}}, r"logit_bias \(keys are token ids\) must be >= 0"),
    ({"logit_bias": {2**63: 1.0}}, r"logit_bias \(keys are token ids\) must be an integer"),
    ({"stop": ["x"], "detokenize": False}, "stop strings need detokenize=True"),
]


@pytest.mark.parametrize(("fields", "message"), INVALID)
def test_invalid_fields(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as caught:
        SamplingParams(**fields)
    named = set(fields) - {"max_tokens"} if "min_tokens" in fields else set(fields)
    named -= {"detokenize"}
    assert caught.value.param in named


def test_valid_edge_values_and_normalisation() -> None:
    p = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, stop="END", max_tokens=None)
    assert p.greedy
    assert p.top_k == 0
    assert p.stop == ["END"]
    assert not p.has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
