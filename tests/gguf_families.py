"""Tiny random models of each family, built with transformers' own config classes, and their
GGUF files written the way llama.cpp's converter writes them: tensor names from gguf's own
``TensorNameMap`` (not the engine's table), Gemma's norm weights stored as 1 + w, experts
stacked into one 3-D tensor per projection, Phi-3's q/k/v and gate/up kept fused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers

from tests.helpers import write_tiny_tokenizer

VOCAB = 320  # above the tiny tokenizer's ~300 ids
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
WINDOW = 12  # the sliding families' window: prompts cross it, and 8-token blocks


def _gemma3() -> transformers.PreTrainedModel:
    config = transformers.Gemma3TextConfig(
        **_COMMON,
        intermediate_size=128,
        head_dim=32,
        query_pre_attn_scalar=32,  # = head_dim: the scale a GGUF file implies (llama.cpp)
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    )
    return transformers.Gemma3ForCausalLM(config)


def _gemma2() -> transformers.PreTrainedModel:
    config = transformers.Gemma2Config(
        **_COMMON,
        intermediate_size=128,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    )
    return transformers.Gemma2ForCausalLM(config)


def _qwen3() -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(
        **_COMMON, intermediate_size=128, head_dim=32, tie_word_embeddings=False
    )
    return transformers.Qwen3ForCausalLM(config)


def _qwen2moe() -> transformers.PreTrainedModel:
    config = transformers.Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,  # as llama.cpp computes Qwen2-MoE
    )
    return transformers.Qwen2MoeForCausalLM(config)


def _qwen3moe() -> transformers.PreTrainedModel:
    config = transformers.Qwen3MoeConfig(
        **_COMMON,
        intermediate_size=96,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,  # as llama.cpp computes Qwen3-MoE
    )
    return transformers.Qwen3MoeForCausalLM(config)


def _phi3() -> transformers.PreTrainedModel:
    config = transformers.Phi3Config(
        **_COMMON, intermediate_size=96, original_max_position_embeddings=512,
        partial_rotary_factor=0.5,
    )  # fmt: skip
    return transformers.Phi3ForCausalLM(config)


FAMILIES: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "gemma3": _gemma3,
    "gemma2": _gemma2,
    "qwen3": _qwen3,
    "qwen2moe": _qwen2moe,
    "qwen3moe": _qwen3moe,
    "phi3": _phi3,
}
SLIDING = ("gemma3", "gemma2")


def family_model(
    name: str, seed: int = 0, vocab_size: int | None = None
) -> transformers.PreTrainedModel:
    """A float32 model of family ``name`` whose norms and biases are perturbed too (Gemma's
    norms start at 0, the others' at 1: a missing norm or a 1 + w mistake must show); with
    ``vocab_size`` below the tokenizer's it emits only the first ids (exact distributions)."""
    torch.manual_seed(seed)
    _COMMON["vocab_size"] = vocab_size or VOCAB
    try:
        model = FAMILIES[name]().float().eval()
    finally:
        _COMMON["vocab_size"] = VOCAB
    with torch.no_grad():
        for key, param in model.named_parameters():
            small = "norm" in key or key.endswith("bias")
            param.add_(torch.randn_like(param) * (0.1 if small else 0.05))
    return model


def write_family_dir(
    directory: Path, name: str, seed: int = 0, vocab_size: int | None = None
) -> transformers.PreTrainedModel:
    """The model saved as a HF directory (safetensors) with a small real tokenizer."""
    model = family_model(name, seed, vocab_size)
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return model


def write_family_gguf(
    path: Path,
    model: transformers.PreTrainedModel,
    qtypes: Callable[[str, np.ndarray], gguf.GGMLQuantizationType | None] | None = None,
) -> None:
    """``model`` as llama.cpp's converter writes it; ``qtypes(gguf name, array)`` picks a
    quantisation per tensor (None: F32)."""
    config = model.config
    arch = _ARCHS[type(model).__name__]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_metadata(writer, config, arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for gguf_name, array in _tensors(model, arch, names).items():
        kind = None if qtypes is None or array.ndim < 2 else qtypes(gguf_name, array)
        if kind is None:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_ARCHS = {
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
}


def _write_metadata(writer: gguf.GGUFWriter, config: Any, arch: gguf.MODEL_ARCH) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    rope = config.rope_parameters
    if arch == gguf.MODEL_ARCH.GEMMA3:
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if arch == gguf.MODEL_ARCH.GEMMA2:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch in (gguf.MODEL_ARCH.QWEN2MOE, gguf.MODEL_ARCH.QWEN3MOE):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == gguf.MODEL_ARCH.QWEN2MOE:
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == gguf.MODEL_ARCH.PHI3:
        writer.add_rope_dimension_count(int(head_dim * config.partial_rotary_factor))


def _tensors(
    model: transformers.PreTrainedModel, arch: gguf.MODEL_ARCH, names: gguf.TensorNameMap
) -> dict[str, np.ndarray]:
    """GGUF name -> array (numpy order) of every tensor, as the converter makes them."""
    gemma = arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        array = tensor.float().numpy().copy()
        if gemma and hf.endswith("norm.weight"):
            array = array + 1.0  # the converter's norm shift
        stem, _, kind = hf.rpartition(".")
        if ".experts." in stem and stem.split(".")[-2].isdigit():  # per-expert (4.x layout)
            prefix, expert, part = stem.rsplit(".", 2)
            experts.setdefault(f"{prefix}.{part}.{kind}", {})[int(expert)] = array
            continue
        if stem.endswith("mlp.experts") and kind in ("gate_up_proj", "down_proj"):
            out.update(_fused_experts(stem, kind, array, names))  # transformers 5's layout
            continue
        out[_name(names, stem, kind)] = array
    for key, parts in experts.items():
        stem, _, kind = key.rpartition(".")
        out[_name(names, stem, kind)] = np.stack([parts[e] for e in sorted(parts)])
    return out


def _fused_experts(
    stem: str, kind: str, array: np.ndarray, names: gguf.TensorNameMap
) -> dict[str, np.ndarray]:
    """transformers 5's fused expert parameters ([E, 2I, H] gate then up, [E, H, I]) as the
    converter stacks them."""
    if kind == "down_proj":
        return {_name(names, f"{stem}.down_proj", "weight"): array}
    half = array.shape[1] // 2
    return {
        _name(names, f"{stem}.gate_proj", "weight"): array[:, :half],
        _name(names, f"{stem}.up_proj", "weight"): array[:, half:],
    }


def _name(names: gguf.TensorNameMap, stem: str, kind: str) -> str:
    mapped = names.get_name(stem)
    if mapped is None:
        raise KeyError(f"gguf has no name for {stem}")
    return f"{mapped}.{kind}"
