"""The student (draft) model: its reduced vocabulary, its shape, its initialisation, saving."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specbatch.kernels.attention.dense_causal import DenseCausalBackend
from specbatch.models.config import ModelConfig
from specbatch.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class StudentShape:
    """A fresh small model, or (``target_layers`` set) one made of some of the target's own
    layers at the target's width, with the input and output embeddings tied (the target's rows
    of the draft vocabulary): pretrained weights that distillation adapts to the missing layers.
    """

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    target_layers: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        if self.target_layers is not None:
            return "L" + "+".join(str(i) for i in self.target_layers)
        return f"{self.num_layers}x{self.hidden_size}"

    def describe(self) -> str:
        if self.target_layers is not None:
            layers = ", ".join(str(i) for i in self.target_layers)
            return f"the target's layers {layers}, tied embeddings"
        return (
            f"{self.num_layers} layers x {self.hidden_size} hidden, {self.num_heads}/"
            f"{self.num_kv_heads} heads, MLP {self.intermediate_size}"
        )


def select_vocabulary(sequences: list[list[int]], size: int, always: set[int]) -> list[int]:
    """The ``size`` most frequent token ids of the corpus (ids in ``always`` included first)."""
    counts = Counter(t for seq in sequences for t in seq)
    chosen = sorted(always)
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if token not in always:
            chosen.append(token)
    return chosen


def student_config(target: ModelConfig, shape: StudentShape, token_map: list[int]) -> ModelConfig:
    if shape.target_layers is not None:
        if not shape.target_layers or not all(
            0 <= i < target.num_hidden_layers for i in shape.target_layers
        ):
            raise ValueError(
                f"student {shape.name}: layers must be among the target's "
                f"0..{target.num_hidden_layers - 1}"
            )
        layers = shape.target_layers
        return replace(
            target,
            vocab_size=len(token_map) + 1,
            num_hidden_layers=len(layers),
            tie_word_embeddings=True,
            token_map=tuple(token_map),
            target_vocab_size=target.vocab_size,
            # the copied layers keep their kinds (sliding or full, experts or dense)
            layer_types=tuple(target.layer_types[i] for i in layers) if target.layer_types else (),
            sparse_layers=tuple(target.layer_sparse(i) for i in layers),
        )
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=len(token_map) + 1,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=target.bos_token_id,
        eos_token_ids=target.eos_token_ids,
        token_map=tuple(token_map),
        target_vocab_size=target.vocab_size,
    )


def build_student(
    config: ModelConfig,
    target: LlamaForCausalLM,
    seed: int,
    target_layers: tuple[int, ...] | None = None,
) -> LlamaForCausalLM:
    """A trainable student. A fresh one's embeddings start as the target's projected onto their
    top principal directions (meaningful from step 0), its layers at small random values; one of
    ``target_layers`` starts as exact copies of those layers, the final norm and the target's
    embedding rows (the extra "other" row their mean)."""
    torch.manual_seed(seed)
    backend = DenseCausalBackend(
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.query_scale,
    )
    backend.softcap = config.attn_logit_softcap
    student = LlamaForCausalLM(config, backend)
    target_embedding = target.model.embed_tokens.weight.detach()
    with torch.no_grad():
        if target_layers is not None:
            rows = target_embedding[list(config.token_map or ())].float()
            student.model.embed_tokens.weight.copy_(torch.cat([rows, rows.mean(0, keepdim=True)]))
            student.model.norm.load_state_dict(target.model.norm.state_dict())
            for mine, theirs in zip(student.model.layers, target_layers, strict=True):
                mine.load_state_dict(target.model.layers[theirs].state_dict())
            return student
        for name, param in student.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
        assert config.token_map is not None
        rows = target_embedding[list(config.token_map)].float()
        mean = rows.mean(0, keepdim=True)
        _, _, v = torch.linalg.svd(rows - mean, full_matrices=False)
        projected = (rows - mean) @ v[: config.hidden_size].T
        projected *= 0.5 / projected.std()
        embedding = torch.cat([projected, projected.mean(0, keepdim=True)])
        student.model.embed_tokens.weight.copy_(embedding)
        assert student.lm_head is not None
        assert student.lm_head.weight is not None
        # normed hidden states have unit RMS per component: scale so initial logits are O(1)
        student.lm_head.weight.copy_(embedding / config.hidden_size**0.5)
    return student


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "torch_dtype": "bfloat16",
        "specbatch_target_vocab_size": config.target_vocab_size,
        "specbatch_token_map": list(config.token_map or ()),
        # a student of a relative's layers (models/families.py) keeps their features; its
        # norms are stored as the model multiplies them (no Gemma shift on load)
        "specbatch_features": config.features(),
    }


def save_student(student: LlamaForCausalLM, directory: Path, metadata: dict[str, str]) -> str:
    """Write ``config.json`` and a bfloat16 ``model.safetensors``; returns the file's sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(student.config), indent=1))
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in student.hf_state_dict().items()}
    path = directory / "model.safetensors"
    save_file(state, str(path), metadata=metadata)
    return hashlib.sha256(path.read_bytes()).hexdigest()
