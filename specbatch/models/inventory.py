"""A checkpoint's tensor directory checked against its config before any module is built.

Headers (GGUF metadata, ``config.json``) and tensor directories (GGUF tensor infos, safetensors
headers) are read without touching tensor data. Comparing the two first means a header that lies
(a billion layers, a terabyte embedding, a changed dimension) fails in milliseconds with the file
and tensor named, instead of sizing the allocation of the model it describes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from specbatch.errors import ModelLoadError
from specbatch.models.config import ModelConfig

Shape = tuple[int, ...]

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class DeclaredTensor:
    """One tensor as a file's header declares it: its name there, torch-order shape, file."""

    name: str
    shape: Shape
    file: str


def checkpoint_shapes(config: ModelConfig) -> dict[str, Shape]:
    """HF name -> torch shape of every tensor a checkpoint of ``config`` holds (HF names;
    experts one by one, as transformers saves them)."""
    hidden = config.hidden_size
    shapes: dict[str, Shape] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for index in range(config.num_hidden_layers):
        for suffix, shape in _layer_shapes(config, index).items():
            shapes[f"model.layers.{index}.{suffix}"] = shape
    return shapes


def _layer_shapes(config: ModelConfig, layer: int) -> dict[str, Shape]:
    from specbatch.models.families import family

    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    fused = family(config.architecture).fused_checkpoint
    shapes: dict[str, Shape] = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.o_proj.weight": (hidden, q_size),
    }
    if fused:
        shapes["self_attn.qkv_proj.weight"] = (q_size + 2 * kv_size, hidden)
    else:
        shapes["self_attn.q_proj.weight"] = (q_size, hidden)
        shapes["self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes["self_attn.v_proj.weight"] = (kv_size, hidden)
    if config.sandwich_norms:
        shapes["pre_feedforward_layernorm.weight"] = (hidden,)
        shapes["post_feedforward_layernorm.weight"] = (hidden,)
    if config.qk_norm:
        shapes["self_attn.q_norm.weight"] = (config.head_dim,)
        shapes["self_attn.k_norm.weight"] = (config.head_dim,)
    if config.layer_sparse(layer):
        shapes.update(_expert_shapes(config))
    else:
        shapes.update(_mlp_shapes("mlp", hidden, inter, fused))
    if config.attention_bias:
        shapes["self_attn.q_proj.bias"] = (q_size,)
        shapes["self_attn.k_proj.bias"] = (kv_size,)
        shapes["self_attn.v_proj.bias"] = (kv_size,)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int, fused: bool = False) -> dict[str, Shape]:
    if fused:
        return {f"{prefix}.gate_up_proj.weight": (2 * inter, hidden),
                f"{prefix}.down_proj.weight": (hidden, inter)}  # fmt: skip
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def _expert_shapes(config: ModelConfig) -> dict[str, Shape]:
    hidden = config.hidden_size
    shapes: dict[str, Shape] = {"mlp.gate.weight": (config.num_experts, hidden)}
    for expert in range(config.num_experts):
        shapes.update(_mlp_shapes(f"mlp.experts.{expert}", hidden, config.moe_intermediate_size))
    shared = config.shared_expert_intermediate_size
    if shared:
        shapes.update(_mlp_shapes("mlp.shared_expert", hidden, shared))
        shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def check_inventory(
    config: ModelConfig,
    declared: Mapping[str, DeclaredTensor],
    source: str,
    layers_key: str,
    file_name: Callable[[str], str] = str,
) -> None:
    """Raise a :class:`ModelLoadError` unless ``declared`` (keyed by HF name) holds exactly the
    tensors ``config`` implies, each of the implied shape.

    ``source`` names the checkpoint, ``layers_key`` the header field giving the layer count, and
    ``file_name`` turns a HF name into the file's own spelling for tensors that are missing.
    """
    _check_layer_count(config.num_hidden_layers, declared, source, layers_key)
    expected = checkpoint_shapes(config)
    for hf_name, tensor in declared.items():
        want = expected.get(hf_name)
        if want is None:
            raise ModelLoadError(
                f"{tensor.file}: unexpected tensor {tensor.name!r} for this architecture"
            )
        if tensor.shape != want:
            raise ModelLoadError(
                f"{tensor.file}: tensor {tensor.name!r} has shape {tensor.shape}, expected "
                f"{want} from the model config"
            )
    missing = [file_name(n) for n in expected if n not in declared]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: missing {len(missing)} tensor(s): {shown}")


def _check_layer_count(
    num_layers: int, declared: Mapping[str, DeclaredTensor], source: str, layers_key: str
) -> None:
    first_of_layer: dict[int, DeclaredTensor] = {}
    for hf_name, tensor in declared.items():
        match = _LAYER_RE.match(hf_name)
        if match:
            first_of_layer.setdefault(int(match.group(1)), tensor)
    beyond = [index for index in first_of_layer if index >= num_layers]
    if beyond:
        tensor = first_of_layer[min(beyond)]
        raise ModelLoadError(
            f"{tensor.file}: tensor {tensor.name!r} belongs to layer {min(beyond)}, but "
            f"{layers_key} is {num_layers}: the header and the tensors disagree"
        )
    absent = next((i for i in range(num_layers) if i not in first_of_layer), None)
    if absent is not None:
        raise ModelLoadError(
            f"{source}: {layers_key} is {num_layers}, but the file has no tensors for layer "
            f"{absent} (it holds {len(first_of_layer)} layers)"
        )
