"""Reading a GGUF file: model config from its metadata, dequantised tensors under HF names."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import torch

from specbatch.errors import ModelLoadError
from specbatch.kernels.block_forms import BLOCK_FORMS
from specbatch.models.config import SIZE_LIMITS, ModelConfig, RopeScaling, check_size
from specbatch.models.families import GGUF_ARCHITECTURES, Family, family
from specbatch.models.gguf_file import GGUFFile
from specbatch.models.inventory import DeclaredTensor, check_inventory

# Every family's layer matrices and biases (norms and the rest: ``Family.gguf_layer_names``).
_LAYER_NAMES = {
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
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(.+)")
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
    layers = _size(gguf_file, f"{arch}.block_count", "num_hidden_layers")
    features = _family_features(gguf_file, arch, layers, hidden, heads, head_dim)
    rope_default = 1_000_000.0 if arch == "gemma3" else 10000.0
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=_vocab_size(gguf_file, arch),
        hidden_size=hidden,
        intermediate_size=_size(
            gguf_file,
            f"{arch}.feed_forward_length",
            "intermediate_size",
            features.get("moe_intermediate_size"),
        ),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_size(
            gguf_file, f"{arch}.attention.head_count_kv", "num_key_value_heads", heads
        ),
        head_dim=head_dim,
        max_position_embeddings=_size(
            gguf_file, f"{arch}.context_length", "max_position_embeddings", 2048
        ),
        rms_norm_eps=_real(gguf_file, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_real(gguf_file, f"{arch}.rope.freq_base", rope_default),
        rope_scaling=_rope_scaling(gguf_file, arch),
        rope_freq_factors=_rope_freq_factors(gguf_file, head_dim),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=_token_id(gguf_file, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        **features,
    )


def _family_features(
    gguf_file: GGUFFile, arch: str, layers: int, hidden: int, heads: int, head_dim: int
) -> dict[str, Any]:
    """The ``ModelConfig`` fields beyond Llama's, as llama.cpp reads them for the family (see
    ``docs/model_families.md``: keys it lacks are llama.cpp's constants)."""
    out: dict[str, Any] = {}
    if arch in ("gemma2", "gemma3"):
        gemma2 = arch == "gemma2"
        # llama.cpp: 1 / sqrt(head_dim), but hidden / heads for the 27B models (46 / 62 layers)
        big = layers == (46 if gemma2 else 62)
        window = gguf_file.get(f"{arch}.attention.sliding_window", 4096 if gemma2 else None)
        pattern = 2 if gemma2 else 6
        out.update(
            hidden_act="gelu_tanh",
            sandwich_norms=True,
            qk_norm=not gemma2,
            embedding_multiplier=math.sqrt(hidden),
            attention_scale=(hidden / heads if big else head_dim) ** -0.5,
            final_logit_softcap=_optional_real(gguf_file, f"{arch}.final_logit_softcapping"),
        )
        if gemma2:
            out["attn_logit_softcap"] = _optional_real(gguf_file, f"{arch}.attn_logit_softcapping")
        if window:
            out["sliding_window"] = _size(gguf_file, f"{arch}.attention.sliding_window",
                                          "max_position_embeddings", window)  # fmt: skip
            out["layer_types"] = _sliding_layers(gguf_file, arch, layers, pattern)
        if not gemma2:
            out["rope_local_theta"] = _real(gguf_file, f"{arch}.rope.freq_base_swa", 10000.0)
    if arch in ("qwen3", "qwen3moe"):
        out["qk_norm"] = True
    if arch in ("qwen2moe", "qwen3moe"):
        out.update(_experts(gguf_file, arch, layers))
    if arch == "phi3":
        rotary = gguf_file.get(f"{arch}.rope.dimension_count", head_dim)
        out["partial_rotary_factor"] = int(rotary) / head_dim
        window = gguf_file.get(f"{arch}.attention.sliding_window")
        if window:
            out["sliding_window"] = int(window)
            out["layer_types"] = ("sliding",) * layers
    return out


def _sliding_layers(gguf_file: GGUFFile, arch: str, layers: int, pattern: int) -> tuple[str, ...]:
    """Which layers slide: ``{arch}.attention.sliding_window_pattern`` (one flag per layer, or
    every n-th layer full), else llama.cpp's pattern for the family (the last of every
    ``pattern`` layers full)."""
    key = f"{arch}.attention.sliding_window_pattern"
    value = gguf_file.get(key, pattern)
    if isinstance(value, list):
        if len(value) != layers or not all(isinstance(v, bool | int) for v in value):
            raise ModelLoadError(f"GGUF metadata {key} must give one flag per layer")
        return tuple("sliding" if v else "full" for v in value)
    every = check_size(f"GGUF metadata {key}", value, layers + 1)
    return tuple("sliding" if (i + 1) % every else "full" for i in range(layers))


def _experts(gguf_file: GGUFFile, arch: str, layers: int) -> dict[str, Any]:
    used = _size(gguf_file, f"{arch}.expert_used_count", "num_attention_heads")
    ffn = gguf_file.get(f"{arch}.feed_forward_length")
    default = int(ffn) // used if isinstance(ffn, int) else None
    # llama.cpp renormalises Qwen3-MoE's chosen weights and never Qwen2-MoE's (its key, where
    # a file has it, decides)
    norm = gguf_file.get(f"{arch}.expert_weights_norm", arch == "qwen3moe")
    return {
        "num_experts": _size(gguf_file, f"{arch}.expert_count", "num_attention_heads"),
        "num_experts_per_tok": used,
        "moe_intermediate_size": _size(
            gguf_file, f"{arch}.expert_feed_forward_length", "intermediate_size", default
        ),
        "shared_expert_intermediate_size": int(
            gguf_file.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0
        ),
        "norm_topk_prob": bool(norm),
        "sparse_layers": (True,) * layers,
    }


def _optional_real(gguf_file: GGUFFile, key: str) -> float | None:
    return _real(gguf_file, key) if gguf_file.get(key) else None


def _size(gguf_file: GGUFFile, key: str, field: str, default: int | None = None) -> int:
    """An integer metadata value within the bound ``SIZE_LIMITS[field]`` sets for it."""
    value = gguf_file.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key}")
    return check_size(f"GGUF metadata {key}", value, SIZE_LIMITS[field])


def _vocab_size(gguf_file: GGUFFile, arch: str) -> int:
    """``{arch}.vocab_size``, else the embedding's rows (llama.cpp's converter trims Gemma 3's
    to the tokenizer's), else the tokenizer's length."""
    if gguf_file.get(f"{arch}.vocab_size") is not None:
        return _size(gguf_file, f"{arch}.vocab_size", "vocab_size")
    embedding = next((t for t in gguf_file.tensors if t.name == "token_embd.weight"), None)
    if embedding is not None and len(embedding.shape) == 2:
        label = "GGUF tensor token_embd.weight (its rows)"
        return check_size(label, embedding.shape[0], SIZE_LIMITS["vocab_size"])
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


def hf_name(gguf_name: str, of: Family) -> str | None:
    """The HF parameter name of a GGUF tensor of a family (an expert stack's with ``{e}`` for
    the expert), ``None`` for tensors that are not parameters."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None:
        return None
    part = of.gguf_layer_names.get(match.group(2)) or _LAYER_NAMES.get(match.group(2))
    return None if part is None else f"model.layers.{match.group(1)}.{part}"


def gguf_tensor_name(hf: str, of: Family) -> str:
    """The GGUF spelling of a HF parameter name (the inverse of :func:`hf_name`)."""
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf:
            return gguf_name
    match = _HF_LAYER_RE.fullmatch(hf)
    if match is None:
        return hf
    part = _EXPERT_RE.sub(r"mlp.experts.{e}.\2", match.group(2))
    for gguf_part, name in {**_LAYER_NAMES, **of.gguf_layer_names}.items():
        if name == part:
            return f"blk.{match.group(1)}.{gguf_part}"
    return hf


def _expert_names(name: str, info_shape: tuple[int, ...]) -> list[str]:
    """The HF names of an expert stack's matrices, in order (one name for any other tensor)."""
    if "{e}" not in name:
        return [name]
    return [name.format(e=e) for e in range(info_shape[0])]


def check_gguf_tensors(gguf_file: GGUFFile, config: ModelConfig) -> None:
    """Check the tensor infos against ``config`` (see :mod:`specbatch.models.inventory`)."""
    path = str(gguf_file.path)
    of = family(config.architecture)
    declared: dict[str, DeclaredTensor] = {}
    for info in gguf_file.tensors:
        if info.name == ROPE_FREQS:  # not a parameter; its length is checked by ModelConfig
            continue
        name = hf_name(info.name, of)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {info.name!r}")
        names = _expert_names(name, info.shape)
        shape = info.shape[1:] if len(names) > 1 or "{e}" in name else info.shape
        for each in names:
            declared[each] = DeclaredTensor(info.name, shape, path)
    layers_key = f"{gguf_file.get('general.architecture')}.block_count"
    check_inventory(config, declared, path, layers_key, lambda n: gguf_tensor_name(n, of))
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
    those named in ``skip``; an expert stack as its experts' matrices)."""
    path = str(gguf_file.path)
    of = family(config.architecture)
    for info in gguf_file.tensors:
        if info.name == ROPE_FREQS:
            continue
        name = hf_name(info.name, of)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {info.name!r}")
        names = [n for n in _expert_names(name, info.shape) if n not in skip]
        if not names:
            continue
        array = gguf_file.dequantize(info)
        if "{e}" not in name:
            yield name, torch.from_numpy(_in_hf_order(array, name, config, of)), path
            continue
        for expert, expert_name in enumerate(_expert_names(name, info.shape)):
            if expert_name in names:
                yield expert_name, torch.from_numpy(np.array(array[expert])), path


def _in_hf_order(array: np.ndarray, name: str, config: ModelConfig, of: Family) -> np.ndarray:
    """A tensor's rows in HF's order (llama.cpp's Q/K permutation undone), writable."""
    if of.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        array = unpermute_rows(array, heads)
    if not array.flags.writeable:  # F32 tensors are views of the read-only file map
        array = array.copy()
    return np.ascontiguousarray(array)


def first_unsupported_matrix(gguf_file: GGUFFile) -> str | None:
    """Why the file's layer matrices cannot all be multiplied as stored, naming the first
    tensor at fault and its type (one no block form holds); None when every one can. Reads the
    tensor directory."""
    for info in gguf_file.tensors:
        if _LAYER_RE.fullmatch(info.name) is None or len(info.shape) < 2:
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
    (llama.cpp's Q/K permutation undone on whole rows of blocks); an expert stack's experts one
    by one (their runs of rows)."""
    of = family(config.architecture)
    for info in gguf_file.tensors:
        kind = info.type_name
        name = hf_name(info.name, of)
        if kind not in BLOCK_FORMS or name is None or len(info.shape) not in (2, 3):
            continue
        raw = gguf_file.raw_rows(info)
        if len(info.shape) == 3:
            rows = info.shape[1]
            for expert, expert_name in enumerate(_expert_names(name, info.shape)):
                yield expert_name, kind, raw[expert * rows : (expert + 1) * rows]
            continue
        if of.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            raw = unpermute_rows(raw, heads)
        yield name, kind, raw
