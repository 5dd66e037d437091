"""Maps a checkpoint's ``architectures`` name to the class that implements it."""

from __future__ import annotations

from specbatch.errors import ModelLoadError
from specbatch.models.llama import LlamaForCausalLM

# Mistral and Qwen2 are Llama with, respectively, a sliding window (handled by capping the context)
# and q/k/v biases (a config flag): one implementation serves all three.
_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

# GGUF `general.architecture` -> HF architecture name
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class for ``architecture``; a :class:`ModelLoadError` lists the supported ones."""
    try:
        return _ARCHITECTURES[architecture]
    except KeyError:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        ) from None
