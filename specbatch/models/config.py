"""The architecture description of a model, independent of where its weights come from."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from specbatch.errors import ModelLoadError

_ROPE_TYPES = ("default", "linear", "llama3")

# Upper bounds on the sizes a config may declare. They exist only to turn a corrupt or hostile
# header into an error before its numbers size an allocation (or a loop building layers), so they
# sit far above every real Llama/Qwen/Mistral model: Llama-3.1-405B has hidden 16384 (bound: 8x),
# intermediate 53248 (2.5x), 126 layers and 128 heads (8x); head_dim is 64-256 in practice (4x);
# the largest vocabularies are ~152k (Qwen2) and 256k (Gemma) (16x); the longest contexts reach
# 10M positions (Llama 4 Scout) (1.7x).
SIZE_LIMITS: Mapping[str, int] = MappingProxyType(
    {
        "vocab_size": 2**22,
        "hidden_size": 2**17,
        "intermediate_size": 2**17,
        "num_hidden_layers": 1024,
        "num_attention_heads": 1024,
        "num_key_value_heads": 1024,
        "head_dim": 1024,
        "max_position_embeddings": 2**24,
    }
)


def check_size(label: str, value: object, limit: int) -> int:
    """``value`` if it is an int in ``[1, limit]``; otherwise a :class:`ModelLoadError` naming
    ``label`` (the field or metadata key, with its file where the caller knows it)."""
    # bool is an int subclass; a true/false where a size belongs is a corrupt file, not 1 or 0.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{label} must be an integer, got {value!r}")
    if not 1 <= value <= limit:
        hint = " (larger than any real model: corrupt file?)" if value > limit else ""
        raise ModelLoadError(f"{label} must be in [1, {limit}], got {value}{hint}")
    return value


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (HF ``rope_scaling`` / ``rope_parameters``)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ModelLoadError(
                f"rope scaling type {self.rope_type!r} is not supported (supported: {_ROPE_TYPES})"
            )
        if self.factor <= 0:
            raise ModelLoadError(f"rope scaling factor must be > 0, got {self.factor}")


ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder of the Llama family and its relatives (Gemma
    2/3, Qwen3, Qwen2/3-MoE, Phi-3: ``models/families.py``), whose differences are the fields
    after the Llama ones: the defaults are Llama's.

    Built from a HF ``config.json`` (:meth:`from_hf_dict`) or from GGUF metadata by the loader.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs`: inv_freq divisors
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Draft models with a reduced vocabulary: row i of the embedding and of the output layer is
    # the target's token token_map[i]; the last row (vocab_size - 1) stands for every other
    # target token on input and is never produced.
    token_map: tuple[int, ...] | None = None
    target_vocab_size: int | None = None
    # The relatives' features.
    hidden_act: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary (Qwen3, Gemma3)
    sandwich_norms: bool = False  # norms after attention and the MLP too (Gemma 2/3)
    embedding_multiplier: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits likewise (Gemma 2)
    sliding_window: int | None = None  # positions a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer "full" or "sliding"; (): all full
    rope_local_theta: float | None = None  # sliding layers' rotary base, unscaled (Gemma 3)
    partial_rotary_factor: float = 1.0  # share of head_dim rotated (Phi-3 family)
    num_experts: int = 0  # routed experts of a sparse MLP (0: dense MLPs)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # a gated shared expert (Qwen2-MoE); 0: none
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights
    sparse_layers: tuple[bool, ...] = ()  # per layer; (): every layer sparse when experts

    def __post_init__(self) -> None:
        for name, limit in SIZE_LIMITS.items():
            check_size(f"model config field {name}", getattr(self, name), limit)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(
                f"head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        self._check_floats()
        self._check_rope_freq_factors()
        self._check_token_map()
        self._check_features()

    def _check_features(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(
                f"hidden activation {self.hidden_act!r} is not supported (supported: "
                f"{', '.join(ACTIVATIONS)})"
            )
        layers = self.num_hidden_layers
        if self.layer_types and (
            len(self.layer_types) != layers or not set(self.layer_types) <= set(LAYER_TYPES)
        ):
            raise ModelLoadError(
                f"layer_types must give one of {LAYER_TYPES} for each of the {layers} layers, "
                f"got {self.layer_types!r}"
            )
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ModelLoadError("sliding layers need a sliding_window of at least 1 position")
        if self.sliding_window is not None:
            check_size("model config field sliding_window", self.sliding_window, 2**24)
        for name in ("embedding_multiplier", "attention_scale", "attn_logit_softcap",
                     "final_logit_softcap", "rope_local_theta"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ModelLoadError(f"{name} must be a positive number, got {value}")
        rotary = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rotary % 2:
            raise ModelLoadError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim "
                f"{self.head_dim} must rotate an even number of dimensions in (0, head_dim]"
            )
        self._check_experts()

    def _check_experts(self) -> None:
        if not self.num_experts:
            return
        check_size("model config field num_experts", self.num_experts, 2**12)
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], got "
                f"{self.num_experts_per_tok}"
            )
        check_size("model config field moe_intermediate_size", self.moe_intermediate_size, 2**17)
        if self.shared_expert_intermediate_size:
            check_size(
                "model config field shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
                2**17,
            )
        if self.sparse_layers and len(self.sparse_layers) != self.num_hidden_layers:
            raise ModelLoadError("sparse_layers must say for every layer whether it is sparse")

    def features(self) -> dict[str, Any]:
        """The relatives' fields (``FEATURES``) that differ from Llama's defaults, as JSON
        values (``from_hf_dict`` reads them back as ``specbatch_features``)."""
        defaults = ModelConfig(**{f: getattr(self, f) for f in _BASE_FIELDS})
        return {
            name: list(value) if isinstance(value, tuple) else value
            for name in FEATURES
            if (value := getattr(self, name)) != getattr(defaults, name)
        }

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that rotate (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def query_scale(self) -> float:
        """What attention scores are multiplied by."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's keys and values take across all layers in ``dtype``."""
        per_token = 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
        return per_token * torch.empty((), dtype=dtype).element_size()

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, or None where it attends every position."""
        if self.layer_types and self.layer_types[layer] == "sliding":
            return self.sliding_window
        return None

    def layer_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        if not self.num_experts:
            return False
        return self.sparse_layers[layer] if self.sparse_layers else True

    def _check_floats(self) -> None:
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            raise ModelLoadError(f"rope_theta must be a positive number, got {self.rope_theta}")
        if not math.isfinite(self.rms_norm_eps) or self.rms_norm_eps < 0:
            raise ModelLoadError(
                f"rms_norm_eps must be a non-negative number, got {self.rms_norm_eps}"
            )

    def _check_rope_freq_factors(self) -> None:
        factors = self.rope_freq_factors
        if factors is not None and len(factors) != self.head_dim // 2:
            raise ModelLoadError(
                f"rope_freq_factors has {len(factors)} entries, expected head_dim / 2 = "
                f"{self.head_dim // 2}"
            )

    def _check_token_map(self) -> None:
        if self.token_map is None:
            return
        target = self.target_vocab_size
        if target is None or len(self.token_map) != self.vocab_size - 1:
            raise ModelLoadError(
                "a token map needs target_vocab_size and vocab_size - 1 entries "
                f"(got {len(self.token_map)} entries for vocab_size {self.vocab_size})"
            )
        check_size("model config field target_vocab_size", target, SIZE_LIMITS["vocab_size"])
        if len(set(self.token_map)) != len(self.token_map) or not all(
            isinstance(t, int) and 0 <= t < target for t in self.token_map
        ):
            raise ModelLoadError(f"token map entries must be distinct ids in [0, {target})")

    @property
    def output_vocab_size(self) -> int:
        """Size of the vocabulary the model's token ids live in (the target's, for a draft
        with a reduced vocabulary)."""
        if self.token_map is not None and self.target_vocab_size is not None:
            return self.target_vocab_size
        return self.vocab_size

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a HF ``config.json`` dictionary (transformers 4.x and 5.x spellings)."""
        from specbatch.models.families import hf_features, hf_rope

        try:
            architectures = raw.get("architectures") or []
            architecture = architectures[0] if architectures else _guess_architecture(raw)
            heads = _size_field(raw, "num_attention_heads")
            hidden = _size_field(raw, "hidden_size")
            rope_theta, rope_scaling_raw, rope_features = hf_rope(raw, architecture)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            fields: dict[str, Any] = {
                "architecture": architecture,
                "vocab_size": _size_field(raw, "vocab_size"),
                "hidden_size": hidden,
                "intermediate_size": _size_field(raw, "intermediate_size"),
                "num_hidden_layers": _size_field(raw, "num_hidden_layers"),
                "num_attention_heads": heads,
                "num_key_value_heads": _size_field(raw, "num_key_value_heads", heads),
                "head_dim": _size_field(raw, "head_dim", hidden // heads),
                "max_position_embeddings": _size_field(raw, "max_position_embeddings", 2048),
                "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
                "rope_theta": rope_theta,
                "rope_scaling": rope_scaling_from_dict(rope_scaling_raw),
                "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
                "attention_bias": bool(raw.get("attention_bias", False)),
                "bos_token_id": raw.get("bos_token_id"),
                "eos_token_ids": eos_ids,
                "token_map": tuple(raw["specbatch_token_map"])
                if "specbatch_token_map" in raw
                else None,
                "target_vocab_size": raw.get("specbatch_target_vocab_size"),
            }
            # the family's own fields and defaults (Gemma ties its embeddings unless told not to)
            fields.update(rope_features)
            fields.update(hf_features(raw, architecture, fields["num_hidden_layers"]))
            for name, value in dict(raw.get("specbatch_features") or {}).items():
                if name not in FEATURES:
                    raise ModelLoadError(f"specbatch_features has an unknown field {name!r}")
                fields[name] = tuple(value) if isinstance(value, list) else value
            return cls(**fields)
        except ModelLoadError:
            raise  # already names the field (it is a ValueError too, so keep it off the next line)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"invalid model config: {type(exc).__name__}: {exc}") from None


def _size_field(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    """A size from ``config.json``, exactly as written: no float or string is coerced, since a
    value of the wrong type there means a damaged or hand-edited file."""
    value = raw.get(key)
    if value is None:  # transformers writes null for "derive it", as for an absent key
        value = default
    if value is None:
        raise ModelLoadError(f"model config field {key} is missing")
    return check_size(f"model config field {key}", value, SIZE_LIMITS[key])


def _guess_architecture(raw: dict[str, Any]) -> str:
    from specbatch.models.families import architecture_of_model_type

    return architecture_of_model_type(str(raw.get("model_type", "")))


def rope_scaling_from_dict(raw: dict[str, Any]) -> RopeScaling:
    if not raw:
        return RopeScaling()
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


# The fields of the relatives' features (after the Llama ones), and the ones every config has.
FEATURES = tuple(f.name for f in dataclasses.fields(ModelConfig))[
    [f.name for f in dataclasses.fields(ModelConfig)].index("hidden_act") :
]
_BASE_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelConfig) if f.name not in FEATURES and f.init
)
