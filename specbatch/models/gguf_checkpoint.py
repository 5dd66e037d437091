"""Reading a GGUF file: model config from its metadata, dequantised tensors under HF names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from specbatch.errors import ModelLoadError
from specbatch.models.config import ModelConfig, RopeScaling
from specbatch.models.gguf_file import GGUFFile
from specbatch.models.registry import GGUF_ARCHITECTURES

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"


def read_gguf_config(gguf_file: GGUFFile) -> ModelConfig:
    """The model config held in a GGUF file's metadata."""
    path = gguf_file.path
    arch = gguf_file.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )

    def meta(key: str, default: Any = None) -> Any:
        value = gguf_file.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tensor_names = {t.name for t in gguf_file.tensors}
    vocab = gguf_file.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = gguf_file.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary size")
    scaling_type = gguf_file.get(f"{arch}.rope.scaling.type", "none")
    rope_scaling = RopeScaling()
    if scaling_type == "linear":
        rope_scaling = RopeScaling("linear", float(meta("rope.scaling.factor")))
    eos = gguf_file.get("tokenizer.ggml.eos_token_id")
    try:
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta("feed_forward_length")),
            num_hidden_layers=int(meta("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(gguf_file.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(gguf_file.get(f"{arch}.attention.key_length", hidden // heads)),
            max_position_embeddings=int(meta("context_length", 2048)),
            rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(gguf_file.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            rope_freq_factors=_rope_freq_factors(gguf_file),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=gguf_file.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


def _rope_freq_factors(gguf_file: GGUFFile) -> tuple[float, ...] | None:
    for tensor in gguf_file.tensors:
        if tensor.name == ROPE_FREQS:
            return tuple(float(x) for x in gguf_file.dequantize(tensor).reshape(-1))
    return None


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, ``None`` for tensors that are not parameters."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved rotary pairs) back to HF's half-split order."""
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_tensors(
    gguf_file: GGUFFile, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield ``(hf_name, float32 tensor, file)``, dequantising one tensor at a time."""
    path = str(gguf_file.path)
    permuted = config.architecture != "Qwen2ForCausalLM"  # llama.cpp permutes only llama-style
    for info in gguf_file.tensors:
        if info.name == ROPE_FREQS:
            continue
        name = hf_name(info.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {info.name!r}")
        array = gguf_file.dequantize(info)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = unpermute_rows(array, heads)
        if not array.flags.writeable:  # F32 tensors are views of the read-only file map
            array = array.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(array)), path
