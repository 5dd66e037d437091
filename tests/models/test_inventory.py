"""The shapes the inventory check expects are exactly the ones the model loads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specbatch.kernels.attention import attention_backend_class
from specbatch.models.config import ModelConfig
from specbatch.models.inventory import checkpoint_shapes
from specbatch.models.llama import LlamaForCausalLM
from tests.helpers import tiny_config


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},  # q/k/v biases
        {"num_key_value_heads": 4, "head_dim": 32},
    ],
)
def test_checkpoint_shapes_match_the_model(overrides: dict[str, Any]) -> None:
    config = ModelConfig.from_hf_dict(tiny_config(**overrides))
    backend = attention_backend_class("torch", torch.device("cpu"))(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, 1.0
    )
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = LlamaForCausalLM(config, backend)
    loaded = {name: tuple(t.shape) for name, t in model.hf_state_dict().items()}
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in checkpoint_shapes(config)
    assert checkpoint_shapes(config) == loaded
