"""Engine configuration: one frozen dataclass, validated when it is built."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specbatch.errors import ConfigError
from specbatch.spec_decode.config import SpeculativeConfig
from specbatch.structured.manager import BACKENDS

if TYPE_CHECKING:
    from specbatch.models.weight_mode import WeightMode


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~specbatch.engine.LLMEngine` is started with.

    ``model`` is a HF directory, a ``.gguf`` file, or None for the default SmolLM2-135M-Instruct.
    ``max_model_len`` defaults to the model's context length. The KV cache holds ``num_kv_blocks``
    blocks of ``block_size`` tokens, or ``kv_cache_gib`` GiB of them, when given; otherwise as
    many as ``max_num_seqs`` sequences of ``max_model_len`` tokens can use, within
    ``kv_cache_memory_fraction`` of the free device memory (on the CPU: of the available RAM,
    and at most ``DEFAULT_CPU_KV_CACHE_GIB``). On the CPU the cache's memory is committed as
    blocks are first used, so a reservation costs nothing until the load needs it.
    ``max_num_batched_tokens`` is the per-step token budget (prefill chunks are cut to fit it).
    ``cpu_weight_packing`` re-lays weights out on the CPU: float32 for MKL's packed GEMM,
    bfloat16 as AMX tiles where the CPU has them (a layer then runs as one C call), else for
    oneDNN (much faster small matmuls; see ``specbatch.kernels.linear``).
    ``quantization`` says how a GGUF model's weights are held: ``"gguf"`` keeps its Q4_1/Q8_0
    matrices quantized and multiplies with them as stored (CPU, float32 activations: the file's
    exact values at a fraction of the bytes per token); None dequantises them to ``dtype``;
    ``"auto"`` (the default) is ``"gguf"`` where that is the fastest exact mode (the CPU, a file
    whose layer matrices the kernel reads, ``dtype="auto"``, one process, a vector path: see
    :mod:`specbatch.models.weight_mode`) and None elsewhere.
    ``enforce_eager`` disables CUDA graphs (captured on CUDA for decode and verify steps).
    ``speculative_config`` chooses how speculative decoding drafts (see
    :class:`~specbatch.spec_decode.config.SpeculativeConfig`): None is ``"auto"`` (on, the
    goodput controller choosing each step's drafts; outputs are the same as without it),
    ``{"method": "off"}`` the plain path.
    ``tensor_parallel_size`` N > 1 splits the target over N processes (Megatron-style, see
    :mod:`specbatch.parallel`): this one and N - 1 workers it starts, over ``torch.distributed``
    (gloo on the CPU, NCCL on CUDA, one GPU each).
    ``structured_outputs_backend`` compiles and matches requests' ``structured_outputs``:
    ``"llguidance"`` (installed with the package) or ``"xgrammar"`` (when installed:
    ``pip install 'specbatch[xgrammar]'``).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    kv_cache_gib: float | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str | None = None
    num_threads: int | None = None
    cpu_weight_packing: bool = True
    quantization: str | None = "auto"
    enforce_eager: bool = False
    speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None
    tensor_parallel_size: int = 1
    structured_outputs_backend: str = "llguidance"

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer", "attention_backend", "quantization"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                if name in ("attention_backend", "quantization") or not isinstance(
                    value, os.PathLike
                ):
                    raise ConfigError(f"{name} must be a string, got {value!r}")
                object.__setattr__(self, name, os.fspath(value))
        _positive("block_size", self.block_size, 1024)
        if self.structured_outputs_backend not in BACKENDS:
            raise ConfigError(
                f"structured_outputs_backend must be one of {list(BACKENDS)}, got "
                f"{self.structured_outputs_backend!r}"
            )
        if self.structured_outputs_backend == "xgrammar" and find_spec("xgrammar") is None:
            raise ConfigError(
                "structured_outputs_backend='xgrammar' needs xgrammar: pip install "
                "'specbatch[xgrammar]' (or use the default, llguidance)"
            )
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("tensor_parallel_size", self.tensor_parallel_size, 64)
        if self.tensor_parallel_size > 1 and self.quantization == "gguf":
            raise ConfigError(
                "quantization='gguf' runs in one process; use tensor_parallel_size=1 with it"
            )
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _fraction("kv_cache_memory_fraction", self.kv_cache_memory_fraction)
        if self.kv_cache_gib is not None:
            _positive_number("kv_cache_gib", self.kv_cache_gib)
        for name in ("enable_prefix_caching", "cpu_weight_packing", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or (
            self.device not in ("auto", "cpu") and not self.device.startswith("cuda")
        ):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.dtype, str):
            raise ConfigError(f"dtype must be a string such as 'float32', got {self.dtype!r}")
        if self.dtype != "auto":
            from specbatch.models.loader import parse_dtype

            parse_dtype(self.dtype)
        if self.attention_backend is not None:
            from specbatch.kernels.attention import available_backends

            if self.attention_backend not in available_backends():
                raise ConfigError(
                    f"unknown attention backend {self.attention_backend!r}; available: "
                    f"{', '.join(available_backends())}"
                )
        if self.quantization is not None:
            from specbatch.models.weight_mode import QUANTIZATION_SETTINGS

            if self.quantization not in QUANTIZATION_SETTINGS:
                raise ConfigError(
                    f"quantization must be one of {', '.join(QUANTIZATION_SETTINGS)} or None, "
                    f"got {self.quantization!r}"
                )
        # A vLLM-style dict becomes a validated SpeculativeConfig (frozen: set it directly).
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """``speculative_config`` as validated at construction (None: speculation off; method
        ``"auto"`` is resolved once the model is loaded)."""
        spec = self.speculative_config
        assert isinstance(spec, SpeculativeConfig)
        return spec if spec.enabled else None

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
        from specbatch.models.weight_mode import dtype_for

        return dtype_for(self.dtype, device)

    def weight_mode(self, path: Path, device: torch.device) -> WeightMode:
        """How the target at ``path`` is loaded on ``device`` (``quantization="auto"``
        resolved: see :mod:`specbatch.models.weight_mode`)."""
        from specbatch.models.weight_mode import resolve_weight_mode

        return resolve_weight_mode(
            self.dtype, self.quantization, path, device, self.tensor_parallel_size
        )


def _fraction(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ConfigError(f"{name} must be a number in (0, 1], got {value!r}")


def _positive_number(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


def _positive(name: str, value: object, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be at most {maximum}, got {value}")
