"""Draft distillation end to end on a tiny random target, the labels stored while generating
against a teacher pass, students made of the target's layers, and the loss going down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.distill import DistillConfig, parse_shape, run
from specbatch.distill.corpus import corpus_parts, load_sequences
from specbatch.distill.pipeline import mix, split_corpus
from specbatch.distill.student import build_student, student_config
from specbatch.distill.teacher import label_shards, load_shards, score_corpus
from specbatch.distill.train import Example, train
from specbatch.kernels.attention.dense_causal import DenseCausalMetadata
from specbatch.models import load_model


@pytest.fixture(scope="module")
def distilled(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> DistillConfig:
    base = tmp_path_factory.mktemp("distill")
    config = DistillConfig(
        work=base / "work",
        out=base / "draft",
        target=str(tiny_model_dir),
        shapes=[parse_shape("1x64"), parse_shape("2x64"), parse_shape("L1")],
        num_prompts=12,
        extra_prompts=6,
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
    assert [r["shape"] for r in report] == ["1x64", "2x64", "L1"]
    assert all(0.0 <= r["alpha"] <= 1.0 and r["c"] > 0 for r in report)
    # the reduced-vocabulary draft drives speculative decoding; greedy output is unchanged
    prompts = [[5, 6, 7, 8], [20, 21, 22]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kwargs = {"num_kv_blocks": 64, "max_model_len": 128, "block_size": 8}
    off = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **kwargs)
    plain = off.generate(prompts, params, use_tqdm=False)
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
    shards = sorted((distilled.work / "teacher").glob("*.safetensors"))
    assert {p.name.rsplit("-", 1)[0] for p in shards} == {
        "generations",
        "generations-extra",
        "text",
    }
    stamps = [p.stat().st_mtime_ns for p in shards]
    run(distilled)  # every stage's output exists: nothing is recomputed
    assert [p.stat().st_mtime_ns for p in shards] == stamps


def test_a_changed_corpus_rescores_only_the_changed_shard(
    distilled: DistillConfig, tiny_model_dir: Path, tmp_path: Path
) -> None:
    teacher = load_model(tiny_model_dir, attention_backend="dense_causal")
    sequences = [[3 + (i * 7 + j) % 80 for j in range(10 + i % 5)] for i in range(300)]
    token_map = list(range(64))
    first = score_corpus(teacher, sequences, token_map, tmp_path, 4, 512, "part")
    assert len(first) == 2  # 256 + 44 sequences
    stamps = [p.stat().st_mtime_ns for p in first]
    sequences[260][3] = 90  # in the second shard only
    again = score_corpus(teacher, sequences, token_map, tmp_path, 4, 512, "part")
    assert again == first
    assert first[0].stat().st_mtime_ns == stamps[0]
    assert first[1].stat().st_mtime_ns != stamps[1]
    assert int(load_shards([first[1]])[4][0][3]) == 90


def test_labels_stored_while_generating_match_a_teacher_pass(
    distilled: DistillConfig, tiny_model_dir: Path, tmp_path: Path
) -> None:
    teacher = load_model(tiny_model_dir, attention_backend="dense_causal")
    token_map = json.loads((distilled.work / "vocab.json").read_text())
    (part,) = [
        p for p in corpus_parts(distilled.work, distilled.max_len) if p.name == "generations"
    ]
    assert all(label is not None for label in part.labels)
    assert all(0 < n < len(s) for n, s in zip(part.prompt_lens, part.sequences, strict=True))
    labels = [label for label in part.labels if label is not None]
    stored = load_shards(label_shards(part.sequences, labels, token_map, tmp_path, 8, "a"))
    scored = load_shards(score_corpus(teacher, part.sequences, token_map, tmp_path, 8, 512, "b"))
    positions = hits = close = 0
    for (ids_a, top_a, p_a), (ids_b, top_b, p_b) in zip(stored, scored, strict=True):
        assert torch.equal(ids_a, ids_b)
        n = len(ids_a) - 1  # the last position's next token was never scored while generating
        assert float(p_a[n].sum()) == 0.0
        # the engine reports the top 20 of the whole vocabulary, the teacher pass the top 8 of
        # the draft's: the leading entries agree except where the draft's best token is outside
        # the engine's top 20 (rare; this random target's distributions are unusually flat)
        hits += int((top_a[:n, 0] == top_b[:n, 0]).sum())
        close += int(((p_a[:n, 0].float() - p_b[:n, 0].float()).abs() <= 2e-3).sum())
        positions += n
    assert hits >= 0.98 * positions
    assert close >= 0.98 * positions


def test_a_student_of_all_the_target_layers_is_the_target(tmp_path: Path) -> None:
    from tests.helpers import write_tiny_model

    tied = write_tiny_model(tmp_path, seed=3, tie_word_embeddings=True)  # as SmolLM2 is
    teacher = load_model(tied, attention_backend="dense_causal")
    token_map = list(range(0, teacher.config.vocab_size, 2))
    shape = parse_shape("L0+1")
    student = build_student(
        student_config(teacher.config, shape, token_map), teacher, 0, shape.target_layers
    )
    assert student.config.tie_word_embeddings
    # ids outside the map read the shared "other" row: the sequence stays inside it
    ids = torch.tensor([[4, 8, 12, 16, 20, 24]])
    positions = torch.arange(6)
    with torch.no_grad():
        want = teacher.compute_logits(teacher(ids.view(-1), positions, DenseCausalMetadata(1, 6)))
        got = student.compute_logits(student(ids.view(-1), positions, DenseCausalMetadata(1, 6)))
    torch.testing.assert_close(got[:, :-1], want[:, token_map], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("text", ["L", "Lx", "L0+a", "3x", "axb"])
def test_bad_student_shapes_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="bad student shape"):
        parse_shape(text)


def test_training_lowers_the_distillation_loss(
    distilled: DistillConfig, tiny_model_dir: Path
) -> None:
    teacher = load_model(tiny_model_dir, attention_backend="dense_causal")
    sequences = load_sequences(distilled.work, distilled.max_len)
    token_map = json.loads((distilled.work / "vocab.json").read_text())
    examples = load_shards(score_corpus(teacher, sequences, token_map, distilled.work, 8, 512))
    student = build_student(
        student_config(teacher.config, parse_shape("1x64"), token_map), teacher, seed=1
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
