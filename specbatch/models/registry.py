"""Maps a checkpoint's ``architectures`` name to the class that implements it."""

from __future__ import annotations

from specbatch.models.families import FAMILIES, GGUF_ARCHITECTURES, family
from specbatch.models.llama import LlamaForCausalLM

__all__ = ["GGUF_ARCHITECTURES", "model_class", "supported_architectures"]


def supported_architectures() -> list[str]:
    return sorted(FAMILIES)


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class for ``architecture`` (one decoder serves every family: ``models/families``);
    a :class:`ModelLoadError` lists the supported ones."""
    family(architecture)
    return LlamaForCausalLM
