"""ModelConfig's size bounds: every real model passes, a corrupt header's numbers do not."""

from __future__ import annotations

from typing import Any

import pytest

from specbatch.errors import ModelLoadError
from specbatch.models.config import ModelConfig

# The largest real models of the supported families, as their config.json gives them.
LLAMA_3_1_405B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}
QWEN2_72B = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
}


@pytest.mark.parametrize("raw", [LLAMA_3_1_405B, QWEN2_72B])
def test_largest_real_models_pass(raw: dict[str, Any]) -> None:
    config = ModelConfig.from_hf_dict(raw)
    assert config.head_dim == 128


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", 2**17 + 1, r"hidden_size must be in \[1, 131072\], got 131073 \(larger"),
        ("num_hidden_layers", 0, r"num_hidden_layers must be in \[1, 1024\], got 0"),
        ("vocab_size", True, "vocab_size must be an integer, got True"),
        ("head_dim", 16.0, "head_dim must be an integer, got 16.0"),
        (
            "max_position_embeddings",
            2**24 + 1,
            r"max_position_embeddings must be in \[1, 16777216\]",
        ),
    ],
)
def test_out_of_range_field_is_named(field: str, value: object, message: str) -> None:
    base = ModelConfig("LlamaForCausalLM", 96, 64, 128, 2, 4, 2, 16, 256)
    with pytest.raises(ModelLoadError, match=message):
        base.replace(**{field: value})


def test_rope_freq_factors_must_cover_head_dim() -> None:
    with pytest.raises(ModelLoadError, match=r"rope_freq_factors has 3 entries, expected .* 8"):
        ModelConfig("LlamaForCausalLM", 96, 64, 128, 2, 4, 2, 16, 256, rope_freq_factors=(1.0,) * 3)
