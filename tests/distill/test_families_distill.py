"""``specbatch distill-draft`` and ``specbatch train-head`` on a Gemma 3 target (a tiny random
one: sliding-window layers, q/k norms, GeGLU, scaled embeddings): a short run of each makes a
draft and a head the engine speculates with, its greedy text that of speculation off; a
student of the target's own layers keeps their features when saved and loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specbatch import LLM
from specbatch.distill import DistillConfig, parse_shape, run
from specbatch.distill.head import HeadTrainConfig
from specbatch.distill.head import run as run_head
from specbatch.distill.student import build_student, save_student, student_config
from specbatch.kernels.attention.dense_causal import DenseCausalBackend, DenseCausalMetadata
from specbatch.models import load_model
from tests.gguf_families import write_family_dir
from tests.helpers import OFF, engine_kwargs, greedy_tokens, prompts_with_variants


@pytest.fixture(scope="module")
def gemma_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gemma3")
    write_family_dir(directory, "gemma3", seed=2)
    return directory


def _speculation_keeps_greedy_text(target: Path, speculation: dict[str, object]) -> None:
    prompts = prompts_with_variants(3, seed=4)
    off = LLM(str(target), speculative_config=OFF, **engine_kwargs())
    expected = greedy_tokens(off, prompts)
    del off
    spec = LLM(str(target), speculative_config=speculation, **engine_kwargs())
    assert greedy_tokens(spec, prompts) == expected
    assert spec.llm_engine.stats.num_draft_tokens > 0


def test_distill_draft_on_a_gemma_target(gemma_target: Path, tmp_path: Path) -> None:
    config = DistillConfig(
        work=tmp_path / "work",
        out=tmp_path / "draft",
        target=str(gemma_target),
        shapes=[parse_shape("1x64"), parse_shape("L1")],
        num_prompts=8,
        extra_prompts=0,
        answer_tokens=12,
        text_chars=3000,
        vocab_size=64,
        top_k=8,
        steps=10,
        tokens_per_batch=256,
        generation_batch=8,
    )
    run(config)
    draft = load_model(config.out)
    assert draft.config.token_map is not None
    _speculation_keeps_greedy_text(
        gemma_target,
        {"method": "draft_model", "model": str(config.out), "num_speculative_tokens": 3,
         "adaptive_k": False},
    )  # fmt: skip


def test_a_student_of_the_targets_layers_keeps_their_features(
    gemma_target: Path, tmp_path: Path
) -> None:
    """Layers 2 (sliding) and 3 (full) of the target as a student: saved and loaded back, it
    computes what it computed (norms, windows, rotary bases and GeGLU kept)."""
    target = load_model(gemma_target)
    token_map = list(range(3, 60))
    config = student_config(target.config, parse_shape("L2+3"), token_map)
    assert config.layer_types == ("sliding", "full")
    student = build_student(config, target, seed=0, target_layers=(2, 3))
    save_student(student, tmp_path / "student", {})
    loaded = load_model(tmp_path / "student")
    assert loaded.config.features() == config.features()
    ids = list(range(3, 40))  # past the window of 12
    torch.testing.assert_close(
        _dense_logits(loaded, ids), _dense_logits(student, ids), rtol=0, atol=2e-2
    )  # fmt: skip  (the file holds bfloat16)


def _dense_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits of one causal row through dense attention (the students' training path)."""
    config = model.config
    backend = DenseCausalBackend(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        config.query_scale,
    )  # fmt: skip
    model.backend = backend
    for layer in model.model.layers:
        layer.self_attn.backend = backend
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalMetadata(1, len(ids)))
        return model.compute_logits(hidden)


def test_train_head_on_a_gemma_target(gemma_target: Path, tmp_path: Path) -> None:
    config = HeadTrainConfig(
        work=tmp_path / "work",
        out=tmp_path / "head",
        target=str(gemma_target),
        num_prompts=6,
        extra_prompts=0,
        answer_tokens=12,
        vocab_size=64,
        steps=3,
        tokens_per_batch=512,
        generation_batch=6,
    )
    run_head(config)
    _speculation_keeps_greedy_text(gemma_target, {"method": "eagle", "model": str(config.out)})
