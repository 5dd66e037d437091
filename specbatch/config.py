"""Engine configuration: one frozen dataclass, validated when it is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from specbatch.errors import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~specbatch.engine.LLMEngine` is started with.

    ``model`` is a HF directory, a ``.gguf`` file, or None for the default SmolLM2-135M-Instruct.
    ``max_model_len`` defaults to the model's context length. The KV cache holds ``num_kv_blocks``
    blocks of ``block_size`` tokens when given; otherwise it takes ``kv_cache_memory_fraction`` of
    the free device memory (on the CPU: of the available RAM, at most ``kv_cache_max_gib``).
    ``max_num_batched_tokens`` is the per-step token budget (prefill chunks are cut to fit it).
    ``cpu_weight_packing`` re-lays float32 weights out for oneDNN on the CPU (much faster small
    matmuls; see ``specbatch.kernels.linear``).
    ``enforce_eager`` disables CUDA graphs (captured on CUDA for decode and verify steps).
    ``speculative_config`` turns speculative decoding on
    (see :class:`~specbatch.spec_decode.config.SpeculativeConfig`).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    kv_cache_max_gib: float = 4.0
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str | None = None
    num_threads: int | None = None
    cpu_weight_packing: bool = True
    enforce_eager: bool = False
    speculative_config: Any = None

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size, 1024)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.kv_cache_max_gib <= 0:
            raise ConfigError(f"kv_cache_max_gib must be > 0, got {self.kv_cache_max_gib}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        from specbatch.spec_decode.config import SpeculativeConfig

        # A vLLM-style dict becomes a validated SpeculativeConfig (frozen: set it directly).
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was requested but CUDA is not available")
        return device

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        from specbatch.models.loader import parse_dtype

        if self.dtype == "auto":
            # bfloat16 matmuls are slower than float32 on CPUs without AMX; GPUs want bf16.
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return parse_dtype(self.dtype)


def _positive(name: str, value: object, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be at most {maximum}, got {value}")
