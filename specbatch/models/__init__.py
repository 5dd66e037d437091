"""Model definitions (Llama family), their configuration, and weight loading."""

from specbatch.models.config import ModelConfig, RopeScaling
from specbatch.models.llama import LlamaForCausalLM
from specbatch.models.loader import load_config, load_model, parse_dtype, resolve_model_path

__all__ = [
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeScaling",
    "load_config",
    "load_model",
    "parse_dtype",
    "resolve_model_path",
]
