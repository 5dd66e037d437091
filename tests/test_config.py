"""EngineConfig and SpeculativeConfig refuse impossible settings at construction, naming them,
and fill the per-method defaults of speculation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specbatch.config import EngineConfig
from specbatch.errors import ConfigError
from specbatch.spec_decode.config import SpeculativeConfig

INVALID: list[tuple[dict[str, Any], str]] = [
    ({"block_size": 0}, "block_size must be a positive integer, got 0"),
    ({"block_size": 2048}, "block_size must be at most 1024"),
    ({"block_size": True}, "block_size must be a positive integer"),
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
    ({"max_num_batched_tokens": "2048"}, "max_num_batched_tokens must be a positive integer"),
    ({"max_model_len": -1}, "max_model_len must be a positive integer"),
    ({"num_kv_blocks": 0}, "num_kv_blocks must be a positive integer"),
    ({"num_threads": 1.5}, "num_threads must be a positive integer"),
    ({"kv_cache_memory_fraction": 0.0}, r"kv_cache_memory_fraction must be a number in \(0, 1\]"),
    ({"kv_cache_memory_fraction": "all"}, "kv_cache_memory_fraction must be a number"),
    ({"kv_cache_gib": 0}, "kv_cache_gib must be a positive number"),
    ({"kv_cache_gib": float("inf")}, "kv_cache_gib must be a positive number"),
    ({"device": "tpu"}, "device must be 'auto', 'cpu' or 'cuda"),
    ({"device": 0}, "device must be 'auto', 'cpu' or 'cuda"),
    ({"seed": "0"}, "seed must be an integer"),
    ({"seed": False}, "seed must be an integer"),
    ({"dtype": "int8"}, "dtype 'int8' is not supported"),
    ({"dtype": 32}, "dtype must be a string"),
    ({"attention_backend": "magic"}, "unknown attention backend 'magic'; available:"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be true or false"),
    ({"enforce_eager": 1}, "enforce_eager must be true or false"),
    ({"model": 3}, "model must be a string"),
    ({"speculative_config": "ngram"}, "speculative_config must be a dict"),
    ({"speculative_config": {"method": "off", "num_speculative_tokens": 3}}, "takes no other"),
    ({"speculative_config": {"method": "auto", "num_speculative_tokens": 0}}, "must be an int"),
    ({"speculative_config": {"method": "medusa"}}, "method must be one of"),
    ({"speculative_config": {"method": "ngram", "k": 3}}, "unknown speculative_config keys"),
    (
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}},
        r"num_speculative_tokens must be an integer in \[1, 16\]",
    ),
    (
        {"speculative_config": {"method": "ngram", "draft_confidence_threshold": 0.5}},
        "draft_confidence_threshold is for methods",
    ),
    (
        {"speculative_config": {"method": "draft_model", "draft_confidence_threshold": 1.0}},
        r"draft_confidence_threshold must be a number in \[0, 1\)",
    ),
    (
        {"speculative_config": {"method": "ngram", "prompt_lookup_min": 5}},
        "1 <= prompt_lookup_min <= prompt_lookup_max",
    ),
    ({"speculative_config": {"method": "ngram", "model": "x"}}, "'model' is for methods"),
]


@pytest.mark.parametrize(("fields", "message"), INVALID)
def test_impossible_settings_fail_at_construction(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


def test_paths_and_defaults() -> None:
    config = EngineConfig(model=Path("/some/model.gguf"))  # type: ignore[arg-type]
    assert config.model == "/some/model.gguf"
    spec = config.speculation  # on by default: "auto", the controller choosing drafts
    assert spec is not None
    assert (spec.method, spec.adaptive_k, spec.k) == ("auto", True, 8)  # k: a ceiling
    assert EngineConfig(speculative_config={"method": "off"}).speculation is None
    assert EngineConfig(speculative_config={"num_speculative_tokens": 6}).speculation == (
        SpeculativeConfig("auto", 6)
    )
    assert SpeculativeConfig().resolved(True).method == "hybrid"
    assert SpeculativeConfig().resolved(False).method == "suffix"  # lookup, and the store
    assert SpeculativeConfig(suffix_store_tokens=0).resolved(False).method == "ngram"
    assert SpeculativeConfig(model="/a/draft").resolved(False).method == "hybrid"
    assert EngineConfig(dtype="bf16", attention_backend="torch").dtype == "bf16"


@pytest.mark.parametrize(
    ("method", "k", "threshold", "lookup_min"),
    [("ngram", 8, 0.0, 1), ("draft_model", 8, 0.5, 1), ("hybrid", 8, 0.5, 2)],
)
def test_speculation_defaults_per_method(
    method: str, k: int, threshold: float, lookup_min: int
) -> None:
    spec = EngineConfig(speculative_config={"method": method}).speculation
    assert spec is not None
    assert (spec.k, spec.confidence_threshold, spec.prompt_lookup_min) == (k, threshold, lookup_min)
    explicit = SpeculativeConfig(method, num_speculative_tokens=2, draft_confidence_threshold=0.0)
    assert (explicit.k, explicit.confidence_threshold) == (2, 0.0)
    assert SpeculativeConfig(method, adaptive_k=False).k == 4  # fixed k: every step drafts k


def test_draft_siblings_default_and_validation() -> None:
    hybrid = SpeculativeConfig(method="hybrid")
    assert hybrid.draft_siblings(cuda_graphs=False)  # on under the controller
    assert not hybrid.draft_siblings(cuda_graphs=True)  # a tree step cannot replay a graph
    assert SpeculativeConfig(method="hybrid", draft_tree=True).draft_siblings(cuda_graphs=True)
    assert not SpeculativeConfig(method="hybrid", adaptive_k=False).draft_siblings(False)
    assert not SpeculativeConfig(method="ngram").draft_siblings(False)
    assert SpeculativeConfig(draft_tree=True).resolved(shipped_draft_fits=False).draft_tree is None
    for bad, message in (
        ({"method": "hybrid", "draft_tree": "yes"}, "draft_tree must be true or false"),
        ({"method": "ngram", "draft_tree": True}, "draft_tree is for methods"),
        ({"method": "hybrid", "draft_tree": True, "adaptive_k": False}, "goodput controller"),
        ({"method": "eagle", "draft_tree_depth": 3}, "draft_tree=true and adaptive_k=false"),
        (
            {
                "method": "eagle",
                "draft_tree": True,
                "adaptive_k": False,
                "draft_tree_depth": 9,
                "num_speculative_tokens": 8,
            },
            r"draft_tree_depth must be an integer in \[1, num_speculative_tokens \(8\)\]",
        ),
        ({"method": "draft_model", "lookup_tree": True}, "lookup_tree is for methods"),
        ({"method": "eagle", "draft_tree_kind": "bushy"}, "draft_tree_kind must be one of"),
        ({"method": "ngram", "draft_tree_kind": "dynamic"}, "draft_tree_kind is for methods"),
    ):
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.parse(bad)


def test_draft_dtype_validation() -> None:
    assert SpeculativeConfig(method="hybrid").draft_dtype == "auto"
    assert SpeculativeConfig(draft_dtype="bfloat16").resolved(False).draft_dtype == "auto"
    assert SpeculativeConfig(draft_dtype="bfloat16").resolved(True).draft_dtype == "bfloat16"
    for bad, message in (
        ({"method": "hybrid", "draft_dtype": "int8"}, "draft_dtype must be one of"),
        ({"method": "draft_model", "draft_dtype": ["bfloat16"]}, "draft_dtype must be one of"),
        ({"method": "ngram", "draft_dtype": "bfloat16"}, "draft_dtype is for methods"),
    ):
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.parse(bad)
