"""Draft distillation end to end on a tiny random target, and the loss going down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.models import load_model
from specbatch.spec.distill import DistillConfig, parse_shape, run
from specbatch.spec.distill.corpus import load_sequences
from specbatch.spec.distill.pipeline import mix, split_corpus
from specbatch.spec.distill.student import build_student, student_config
from specbatch.spec.distill.teacher import load_shards, score_corpus
from specbatch.spec.distill.train import Example, train


@pytest.fixture(scope="module")
def distilled(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> DistillConfig:
    base = tmp_path_factory.mktemp("distill")
    config = DistillConfig(
        work=base / "work",
        out=base / "draft",
        target=str(tiny_model_dir),
        shapes=[parse_shape("1x64"), parse_shape("2x64")],
        num_prompts=12,
        answer_tokens=16,
        text_chars=6000,
        vocab_size=64,
        top_k=8,
        steps=30,
        tokens_per_batch=512,
        generation_batch=8,
    )
    run(config)
    return config


def test_pipeline_writes_a_loadable_draft(distilled: DistillConfig, tiny_model_dir: Path) -> None:
    draft = load_model(distilled.out)
    assert draft.config.token_map is not None
    assert len(draft.config.token_map) == 64
    assert draft.config.output_vocab_size == load_model(tiny_model_dir).config.vocab_size
    report = json.loads((distilled.work / "students.json").read_text())
    assert [r["shape"] for r in report] == ["1x64", "2x64"]
    assert all(0.0 <= r["alpha"] <= 1.0 and r["c"] > 0 for r in report)
    # the reduced-vocabulary draft drives speculative decoding; greedy output is unchanged
    prompts = [[5, 6, 7, 8], [20, 21, 22]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kwargs = {"num_kv_blocks": 64, "max_model_len": 128, "block_size": 8}
    plain = LLM(str(tiny_model_dir), **kwargs).generate(prompts, params, use_tqdm=False)
    spec = LLM(
        str(tiny_model_dir),
        speculative_config={
            "method": "draft_model",
            "model": str(distilled.out),
            "num_speculative_tokens": 3,
        },
        **kwargs,
    )
    fast = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert spec.llm_engine.stats.num_draft_tokens > 0


def test_stages_are_resumable(distilled: DistillConfig) -> None:
    shards = sorted((distilled.work / "teacher").glob("shard-*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    run(distilled)  # every stage's output exists: nothing is recomputed
    assert [p.stat().st_mtime_ns for p in shards] == stamps


def test_training_lowers_the_distillation_loss(
    distilled: DistillConfig, tiny_model_dir: Path
) -> None:
    teacher = load_model(tiny_model_dir, attention_backend="dense_causal")
    sequences = load_sequences(distilled.work, distilled.max_len)
    token_map = json.loads((distilled.work / "vocab.json").read_text())
    examples = load_shards(score_corpus(teacher, sequences, token_map, distilled.work, 8, 512))
    student = build_student(
        student_config(teacher.config, parse_shape("1x64"), token_map),
        teacher.model.embed_tokens.weight,
        seed=1,
    )
    losses = train(
        student,
        examples,
        steps=40,
        tokens_per_batch=512,
        lr=3e-3,
        checkpoint=distilled.work / "fresh-checkpoint",
        seed=1,
    )
    assert sum(losses[-8:]) / 8 < 0.9 * sum(losses[:8]) / 8


def _examples(lengths: list[int]) -> list[Example]:
    return [
        (torch.full((n,), i), torch.zeros(n, 2), torch.ones(n, 2)) for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("share", [0.0, 0.1, 0.3, 0.6, 0.99])
def test_mix_keeps_every_answer_and_caps_the_text_share(share: float) -> None:
    answers = _examples([50] * 40)
    text = _examples([37, 120, 64, 200, 90, 15, 300, 80] * 10)
    mixed = mix(answers, text, share)
    assert mixed[: len(answers)] == answers
    text_tokens = sum(len(e[0]) for e in mixed[len(answers) :])
    total = sum(len(e[0]) for e in mixed)
    assert text_tokens <= share * total + 1e-9
    if 0 < share < 0.9:  # the cap is reached to within one text sequence
        assert text_tokens + 300 > share / (1 - share) * 2000
    assert mix(answers, [], share) == answers


def test_split_holds_out_part_of_each_kind_disjointly() -> None:
    examples = _examples([10 + i for i in range(95)])
    answers, text = split_corpus(examples, 65)
    assert len(answers.held_out) == 2  # 65 answers: the 30th and 60th
    assert len(text.held_out) == 1
    ids = [int(e[0][0]) for part in (answers, text) for e in part.train + part.held_out]
    assert sorted(ids) == list(range(95))
    assert {int(e[0][0]) for e in answers.train + answers.held_out} == set(range(65))
    small, _ = split_corpus(examples[:3], 3)
    assert len(small.held_out) == 1
