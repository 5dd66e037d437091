"""Writes a HF-named state dict as a GGUF file the way llama.cpp's converter lays it out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:])]}"


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF half-split rotary -> interleaved pairs)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    path: Path,
    config: dict[str, Any],
    state: dict[str, torch.Tensor],
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
    raw_tensors: dict[str, np.ndarray] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> None:
    """``qtypes`` maps HF names to a quantisation; ``raw_tensors`` gives prequantised bytes."""
    arch = {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "MistralForCausalLM": "llama",
    }[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    qtypes = qtypes or {}
    raw_tensors = raw_tensors or {}
    for hf, tensor in state.items():
        if hf == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        array = tensor.float().numpy()
        if arch == "llama" and hf.endswith("q_proj.weight"):
            array = permute_rows(array, config["num_attention_heads"])
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            array = permute_rows(array, config["num_key_value_heads"])
        name = gguf_name(hf)
        if hf in raw_tensors:
            writer.add_tensor(name, raw_tensors[hf], raw_dtype=qtypes[hf])
        elif qtypes.get(hf) == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        elif hf in qtypes:
            data = gguf.quants.quantize(array, qtypes[hf])
            writer.add_tensor(name, data, raw_dtype=qtypes[hf])
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
