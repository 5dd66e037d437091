"""The model families beside Llama, and how each one's HF ``config.json`` and GGUF file say
what it is: Gemma 2 and 3, Qwen3, Qwen2-MoE and Qwen3-MoE, Phi-3 (and Llama, Mistral, Qwen2).

One decoder (``models/llama.py``) runs them all; a family is a set of ``ModelConfig`` features
(``docs/model_families.md`` has what transformers and llama.cpp compute for each, with sources):

* Gemma 2/3: GeGLU (tanh GELU), norms before *and* after attention and the MLP, embeddings
  times sqrt(hidden), scores scaled by ``query_pre_attn_scalar ** -0.5``, sliding-window layers
  (Gemma 2: even layers; Gemma 3: five of every six) with, in Gemma 3, their own rotary base;
  Gemma 2 soft-caps scores and logits, Gemma 3 normalises q and k per head. HF checkpoints store
  norm weights w for ``x (1 + w)``; GGUF files store 1 + w (llama.cpp's converter adds it), so
  the HF loader adds 1 (:func:`hf_norm_shift`) and both multiply by the stored weight.
* Qwen3: q/k norms. Qwen2/3-MoE: routed experts (top-k of a softmax over all experts), Qwen2-MoE
  with a sigmoid-gated shared expert. Phi-3: q/k/v and gate/up stored fused, partial rotary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from specbatch.errors import ModelLoadError

GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class Family:
    """How one HF architecture's files name and lay out its weights."""

    architecture: str
    gguf_arch: str
    model_types: tuple[str, ...]
    permute_qk: bool = False  # llama.cpp permutes Q/K rows of llama-style models only
    # GGUF block tensor -> HF name under model.layers.N (the matrices and biases of llama are
    # everyone's; norms and the rest differ)
    gguf_layer_names: dict[str, str] = field(default_factory=dict)
    fused_checkpoint: bool = False  # q/k/v and gate/up stored fused (Phi-3)


_LLAMA_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GEMMA_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_QK_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    # 3-D: every expert's matrix stacked ([E, out, in] in numpy order); {e} is the expert
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}
_SHARED_EXPERT = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_PHI3_FUSED = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}

FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family("LlamaForCausalLM", "llama", ("llama",), True, _LLAMA_NORMS),
        Family("MistralForCausalLM", "mistral", ("mistral",), True, _LLAMA_NORMS),
        Family("Qwen2ForCausalLM", "qwen2", ("qwen2",), False, _LLAMA_NORMS),
        Family("Gemma2ForCausalLM", "gemma2", ("gemma2",), False, _GEMMA_NORMS),
        Family(
            "Gemma3ForCausalLM", "gemma3", ("gemma3_text", "gemma3"), False,
            {**_GEMMA_NORMS, **_QK_NORMS},
        ),
        Family("Qwen3ForCausalLM", "qwen3", ("qwen3",), False, {**_LLAMA_NORMS, **_QK_NORMS}),
        Family(
            "Qwen2MoeForCausalLM", "qwen2moe", ("qwen2_moe",), False,
            {**_LLAMA_NORMS, **_EXPERTS, **_SHARED_EXPERT},
        ),
        Family(
            "Qwen3MoeForCausalLM", "qwen3moe", ("qwen3_moe",), False,
            {**_LLAMA_NORMS, **_QK_NORMS, **_EXPERTS},
        ),
        Family(
            "Phi3ForCausalLM", "phi3", ("phi3",), False, {**_LLAMA_NORMS, **_PHI3_FUSED}, True
        ),
    )
}  # fmt: skip
GGUF_ARCHITECTURES = {f.gguf_arch: f.architecture for f in FAMILIES.values()}


def family(architecture: str) -> Family:
    """The family of a HF architecture name; ``ModelLoadError`` listing the supported ones."""
    found = FAMILIES.get(architecture)
    if found is None:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return found


def architecture_of_model_type(model_type: str) -> str:
    """The HF architecture of a ``config.json`` without ``architectures``."""
    for candidate in FAMILIES.values():
        if model_type in candidate.model_types:
            return candidate.architecture
    return model_type


def hf_norm_shift(architecture: str) -> bool:
    """Whether HF checkpoints of the family store norm weights w for ``x (1 + w)`` (GGUF files
    store 1 + w, and the model multiplies by the stored weight)."""
    return architecture in GEMMA


# ---------------------------------------------------------------- HF config.json


def hf_rope(raw: dict[str, Any], architecture: str) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """``(rope_theta, rope scaling dict, extra fields)`` of a ``config.json``: transformers 4's
    ``rope_theta``/``rope_scaling`` (Gemma 3: ``rope_local_base_freq``) or 5's
    ``rope_parameters`` (Gemma 3: nested by layer type, the scaling on full layers only)."""
    params = dict(raw.get("rope_parameters") or {})
    extra: dict[str, Any] = {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError("scaled rotary embeddings on sliding layers are not supported")
        extra["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
        return float(full.get("rope_theta", 1_000_000.0)), full, extra
    default_theta = 1_000_000.0 if architecture == "Gemma3ForCausalLM" else 10000.0
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or default_theta)
    if architecture == "Gemma3ForCausalLM":
        extra["rope_local_theta"] = float(raw.get("rope_local_base_freq") or 10000.0)
    scaling = raw.get("rope_scaling") or params
    if scaling.get("rope_type", scaling.get("type")) in ("longrope", "su", "yarn"):
        raise ModelLoadError(
            f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r} is not supported "
            "(Phi-3's long-context variants); the 4k models have none"
        )
    return theta, scaling, extra


def hf_features(raw: dict[str, Any], architecture: str, layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields a family's ``config.json`` sets beyond Llama's."""
    out: dict[str, Any] = {}
    if architecture in GEMMA:
        out.update(_hf_gemma(raw, architecture, layers))
    if architecture in QWEN3:
        out["qk_norm"] = True
    if architecture in MOE:
        out.update(_hf_experts(raw, layers))
    if architecture == "Qwen2ForCausalLM" or architecture == "Qwen2MoeForCausalLM":
        out["attention_bias"] = bool(raw.get("qkv_bias", raw.get("attention_bias", True)))
    if architecture == "Phi3ForCausalLM":
        params = raw.get("rope_parameters") or {}
        out["partial_rotary_factor"] = float(
            raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
        )
    out.update(_hf_sliding(raw, architecture, layers))
    return out


def _hf_gemma(raw: dict[str, Any], architecture: str, layers: int) -> dict[str, Any]:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"Gemma hidden_activation {activation!r} is not supported")
    gemma2 = architecture == "Gemma2ForCausalLM"
    out: dict[str, Any] = {
        "hidden_act": "gelu_tanh",
        "sandwich_norms": True,
        "qk_norm": not gemma2,
        "embedding_multiplier": math.sqrt(hidden),
        "attention_scale": float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "final_logit_softcap": _positive(
            raw.get("final_logit_softcapping", 30.0 if gemma2 else None)
        ),
    }
    if gemma2:  # Gemma 3 never soft-caps scores, whatever its config says
        out["attn_logit_softcap"] = _positive(raw.get("attn_logit_softcapping", 50.0))
    if not raw.get("layer_types"):  # the default pattern: the last of every group is full
        pattern = 2 if gemma2 else int(raw.get("sliding_window_pattern") or 6)
        out["layer_types"] = tuple(
            "sliding" if (i + 1) % pattern else "full" for i in range(layers)
        )
        out["sliding_window"] = int(raw.get("sliding_window") or (4096 if gemma2 else 512))
    return out


def _hf_experts(raw: dict[str, Any], layers: int) -> dict[str, Any]:
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(raw.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size") or 0),
        "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "sparse_layers": tuple(
            experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)
        ),
    }


def _hf_sliding(raw: dict[str, Any], architecture: str, layers: int) -> dict[str, Any]:
    """Which layers slide, and over how many positions: ``layer_types`` where the file has
    them, else the family's rule (Mistral, Phi-3: every layer when a window is given; Qwen:
    the layers from ``max_window_layers`` on, only with ``use_sliding_window``)."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types:
        names = {"sliding_attention": "sliding", "full_attention": "full"}
        if any(t not in names for t in types):
            raise ModelLoadError(
                f"layer_types must be sliding_attention or full_attention: {types}"
            )
        converted = tuple(names[t] for t in types)
        return {"layer_types": converted, "sliding_window": int(window) if window else None}
    if architecture in GEMMA or not window:
        return {}
    if architecture.startswith("Qwen"):
        if not raw.get("use_sliding_window", False):
            return {}
        first = int(raw.get("max_window_layers", layers))
        sliding = tuple("sliding" if i >= first else "full" for i in range(layers))
    else:
        sliding = ("sliding",) * layers
    return {"layer_types": sliding, "sliding_window": int(window)}


def _positive(value: Any) -> float | None:
    return float(value) if value else None
