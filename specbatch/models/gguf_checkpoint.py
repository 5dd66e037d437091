"""Reading a GGUF file: model config from its metadata, dequantised tensors under HF names."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterator

import numpy as np
import torch

from specbatch.errors import ModelLoadError
from specbatch.kernels.block_forms import BLOCK_FORMS
from specbatch.models.config import SIZE_LIMITS, ModelConfig, RopeScaling, check_size
from specbatch.models.gguf_file import GGUFFile
from specbatch.models.inventory import DeclaredTensor, check_inventory
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
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_LAYER_NAMES = {hf: gguf for gguf, hf in _LAYER_NAMES.items()}
_GGUF_GLOBAL_NAMES = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
ROPE_FREQS = "rope_freqs.weight"


def read_gguf_config(gguf_file: GGUFFile) -> ModelConfig:
    """The model config held in a GGUF file's metadata; a missing, mistyped or out-of-range
    value is a :class:`ModelLoadError` naming the file and the key."""
    arch = gguf_file.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_file.path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    try:
        return _config_from_metadata(gguf_file, arch)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{gguf_file.path}: {exc}") from None


def _config_from_metadata(gguf_file: GGUFFile, arch: str) -> ModelConfig:
    # Every size is validated before it is used: head_count divides embedding_length below.
    heads = _size(gguf_file, f"{arch}.attention.head_count", "num_attention_heads")
    hidden = _size(gguf_file, f"{arch}.embedding_length", "hidden_size")
    head_dim = _size(gguf_file, f"{arch}.attention.key_length", "head_dim", hidden // heads)
    tensor_names = {t.name for t in gguf_file.tensors}
    eos = _token_id(gguf_file, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=_vocab_size(gguf_file, arch),
        hidden_size=hidden,
        intermediate_size=_size(gguf_file, f"{arch}.feed_forward_length", "intermediate_size"),
        num_hidden_layers=_size(gguf_file, f"{arch}.block_count", "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_size(
            gguf_file, f"{arch}.attention.head_count_kv", "num_key_value_heads", heads
        ),
        head_dim=head_dim,
        max_position_embeddings=_size(
            gguf_file, f"{arch}.context_length", "max_position_embeddings", 2048
        ),
        rms_norm_eps=_real(gguf_file, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_real(gguf_file, f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(gguf_file, arch),
        rope_freq_factors=_rope_freq_factors(gguf_file, head_dim),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=_token_id(gguf_file, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _size(gguf_file: GGUFFile, key: str, field: str, default: int | None = None) -> int:
    """An integer metadata value within the bound ``SIZE_LIMITS[field]`` sets for it."""
    value = gguf_file.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key}")
    return check_size(f"GGUF metadata {key}", value, SIZE_LIMITS[field])


def _vocab_size(gguf_file: GGUFFile, arch: str) -> int:
    if gguf_file.get(f"{arch}.vocab_size") is not None:
        return _size(gguf_file, f"{arch}.vocab_size", "vocab_size")
    tokens = gguf_file.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ModelLoadError(
            f"GGUF metadata gives no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)"
        )
    label = "GGUF metadata tokenizer.ggml.tokens (its length)"
    return check_size(label, len(tokens), SIZE_LIMITS["vocab_size"])


def _real(gguf_file: GGUFFile, key: str, default: float | None = None) -> float:
    value = gguf_file.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelLoadError(f"GGUF metadata {key} must be a finite number, got {value!r}")
    return float(value)


def _token_id(gguf_file: GGUFFile, key: str) -> int | None:
    value = gguf_file.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ModelLoadError(f"GGUF metadata {key} must be a token id (an int >= 0), got {value!r}")
    return value


def _rope_scaling(gguf_file: GGUFFile, arch: str) -> RopeScaling:
    if gguf_file.get(f"{arch}.rope.scaling.type", "none") == "linear":
        return RopeScaling("linear", _real(gguf_file, f"{arch}.rope.scaling.factor"))
    return RopeScaling()


def _rope_freq_factors(gguf_file: GGUFFile, head_dim: int) -> tuple[float, ...] | None:
    for tensor in gguf_file.tensors:
        if tensor.name == ROPE_FREQS:
            # Checked before it is read: it becomes a Python tuple, one object per entry.
            if tensor.shape != (head_dim // 2,):
                raise ModelLoadError(
                    f"tensor {ROPE_FREQS!r} has shape {tensor.shape}, expected "
                    f"{(head_dim // 2,)} (head_dim / 2)"
                )
            return tuple(float(x) for x in gguf_file.dequantize(tensor))
    return None


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, ``None`` for tensors that are not parameters."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def gguf_tensor_name(hf: str) -> str:
    """The GGUF spelling of a HF parameter name (the inverse of :func:`hf_name`)."""
    if hf in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf]
    match = _HF_LAYER_RE.fullmatch(hf)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"blk.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"
    return hf


def check_gguf_tensors(gguf_file: GGUFFile, config: ModelConfig) -> None:
    """Check the tensor infos against ``config`` (see :mod:`specbatch.models.inventory`)."""
    path = str(gguf_file.path)
    declared: dict[str, DeclaredTensor] = {}
    for info in gguf_file.tensors:
        if info.name == ROPE_FREQS:  # not a parameter; its length is checked by ModelConfig
            continue
        name = hf_name(info.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {info.name!r}")
        declared[name] = DeclaredTensor(info.name, info.shape, path)
    layers_key = f"{gguf_file.get('general.architecture')}.block_count"
    check_inventory(config, declared, path, layers_key, gguf_tensor_name)
    gguf_file.check_disjoint()


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (interleaved rotary pairs) back to HF's half-split order."""
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_tensors(
    gguf_file: GGUFFile, config: ModelConfig, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield ``(hf_name, float32 tensor, file)``, dequantising one tensor at a time (none of
    those named in ``skip``)."""
    path = str(gguf_file.path)
    permuted = config.architecture != "Qwen2ForCausalLM"  # llama.cpp permutes only llama-style
    for info in gguf_file.tensors:
        if info.name == ROPE_FREQS:
            continue
        name = hf_name(info.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {info.name!r}")
        if name in skip:
            continue
        array = gguf_file.dequantize(info)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = unpermute_rows(array, heads)
        if not array.flags.writeable:  # F32 tensors are views of the read-only file map
            array = array.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(array)), path


_LAYER_MATRICES = {name for name in _LAYER_NAMES if name.endswith("weight") and "norm" not in name}


def first_unsupported_matrix(gguf_file: GGUFFile) -> str | None:
    """Why the file's layer matrices cannot all be multiplied as stored, naming the first
    tensor at fault and its type (one no block form holds); None when every one can. Reads the
    tensor directory."""
    for info in gguf_file.tensors:
        match = _LAYER_RE.fullmatch(info.name)
        if match is None or match.group(2) not in _LAYER_MATRICES:
            continue
        if info.type_name not in BLOCK_FORMS:
            return (
                f"{info.name} is {info.type_name}, which the kernels do not multiply "
                f"(they read {', '.join(BLOCK_FORMS)})"
            )
    return None


def iter_gguf_quantized(
    gguf_file: GGUFFile, config: ModelConfig
) -> Iterator[tuple[str, str, np.ndarray]]:
    """Yield ``(hf_name, ggml type name, raw rows)`` for the matrices stored in a type a block
    form holds (``BLOCK_FORMS``): uint8 [out_features, blocks bytes], rows in HF order
    (llama.cpp's Q/K permutation undone on whole rows of blocks)."""
    permuted = config.architecture != "Qwen2ForCausalLM"
    for info in gguf_file.tensors:
        kind = info.type_name
        name = hf_name(info.name)
        if kind not in BLOCK_FORMS or name is None or len(info.shape) != 2:
            continue
        raw = gguf_file.raw_rows(info)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            raw = unpermute_rows(raw, heads)
        yield name, kind, raw
