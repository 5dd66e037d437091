"""``specbatch distill-draft``: corpus, soft labels, students of several sizes, pick the best.

Every stage writes its result into the work directory and is skipped when that result exists,
so the whole command can be interrupted and run again. For each student shape it reports alpha
(greedy agreement with the target at the answer positions of the held-out answers; every
position of the held-out plain text) and c (one draft decode step over one target decode step,
measured here), and keeps the shape with the best expected speedup
``(1 - a^(k+1)) / ((1 - a) (k c + 1))`` (Leviathan et al.) at ``k = 4``.

This alpha ranks students; it is not the acceptance rate in use, which is lower (the held-out
answers come from the same prompt templates as the training ones): 0.48 for the shipped draft,
whose acceptance on Spec-Bench, measured by ``benchmarks/draft_quality.py``, is 0.29. Use that
benchmark for the real figure.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import torch

from specbatch.cache.kv_tensors import allocate_kv_caches
from specbatch.distill.corpus import answered_corpus
from specbatch.distill.student import (
    StudentShape,
    build_student,
    save_student,
    select_vocabulary,
    student_config,
)
from specbatch.distill.teacher import label_shards, load_shards, run_dense, score_corpus
from specbatch.distill.train import Example, train
from specbatch.models import load_model, resolve_model_path
from specbatch.models.llama import LlamaForCausalLM
from specbatch.runner.flat_batch import TokenRun, flatten
from specbatch.runner.model_runner import ModelRunner
from specbatch.tokenizer import load_tokenizer

HELD_OUT_EVERY = 30
T = TypeVar("T")


@dataclass
class DistillConfig:
    """Everything ``specbatch distill-draft`` takes (see its ``--help``)."""

    work: Path
    out: Path
    target: str | None = None
    shapes: list[StudentShape] = field(default_factory=lambda: [StudentShape()])
    num_prompts: int = 2000
    extra_prompts: int = 0
    answer_tokens: int = 192
    text_chars: int = 1_500_000
    text_share: float = 0.3
    vocab_size: int = 8192
    top_k: int = 16
    max_len: int = 1152
    steps: int = 3000
    tokens_per_batch: int = 4096
    lr: float = 2e-3
    seed: int = 0
    generation_batch: int = 32


def parse_shape(text: str) -> StudentShape:
    """``LAYERSxHIDDEN`` (e.g. ``4x256``: heads of 64, half as many KV heads, MLP 3x), or
    ``L`` and target layer indices joined by ``+`` (e.g. ``L0+29``: those layers of the target,
    see ``StudentShape``)."""
    if text[:1] in "Ll":
        try:
            indices = tuple(int(x) for x in text[1:].split("+"))
        except ValueError:
            raise ValueError(f"bad student shape {text!r}: expected e.g. L0+29") from None
        return StudentShape(target_layers=indices)
    try:
        layers, hidden = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"bad student shape {text!r}: expected e.g. 2x256 or L0+29") from None
    heads = max(1, hidden // 64)
    return StudentShape(hidden, layers, heads, max(1, heads // 2), 3 * hidden)


def run(config: DistillConfig) -> Path:
    work = config.work
    parts = answered_corpus(config, config.text_chars)
    # the vocabulary comes from the base answers and the text (it was fixed before the extra
    # prompt families existed; recomputing it would mean scoring all of them again)
    token_map = _vocabulary(
        config, [s for part in parts if part.name != "generations-extra" for s in part.sequences]
    )
    teacher = load_model(config.target, attention_backend="dense_causal")
    teacher.pack_for_cpu()
    shards = []
    for part in parts:
        labels = [label for label in part.labels if label is not None]
        if len(labels) == len(part.sequences):  # labelled while generating: no teacher pass
            shards += label_shards(part.sequences, labels, token_map, work, config.top_k, part.name)
        else:
            shards += score_corpus(
                teacher, part.sequences, token_map, work, config.top_k, 2048, part.name
            )
    examples = load_shards(shards)
    num_answers = sum(len(part.sequences) for part in parts if part.name != "text")
    answers, text = split_corpus(examples, num_answers)
    starts = split_corpus(
        [p for part in parts for p in part.prompt_lens][:num_answers], num_answers
    )[0]
    train_set = mix(answers.train, text.train, config.text_share)
    print(
        f"corpus: {len(answers.train)} answers and {len(text.train)} text sequences for "
        f"training ({_tokens(answers.train)} + {_tokens(text.train)} tokens; trained on "
        f"{len(train_set)} sequences, {_tokens(train_set)} tokens, text share at most "
        f"{config.text_share:.0%}), {len(answers.held_out) + len(text.held_out)} held out; "
        f"draft vocabulary {len(token_map)}",
        flush=True,
    )
    target_ms = decode_ms(load_and_pack(config.target))
    results = []
    del teacher  # its linear weights are packed for inference; students copy plain ones
    source = load_model(config.target, attention_backend="dense_causal")
    for shape in config.shapes:
        name = shape.name
        student = build_student(
            student_config(source.config, shape, token_map),
            source,
            config.seed,
            shape.target_layers,
        )
        train(
            student,
            train_set,
            config.steps,
            config.tokens_per_batch,
            config.lr,
            work / f"checkpoint-{name}",
            config.seed,
        )
        alpha = greedy_agreement(student, answers.held_out, starts.held_out)
        alpha_text = greedy_agreement(student, text.held_out) if text.held_out else float("nan")
        directory = work / f"student-{name}"
        digest = save_student(student, directory, {"shape": shape.describe()})
        c = decode_ms(load_and_pack(str(directory))) / target_ms
        speedup = expected_speedup(alpha, c, k=4)
        results.append(
            {
                "shape": name,
                "describe": shape.describe(),
                "alpha": alpha,
                "alpha_text": alpha_text,
                "c": c,
                "expected_speedup_k4": speedup,
                "sha256": digest,
            }
        )
        print(
            f"student {shape.describe()}: alpha {alpha:.3f} (answers; plain text "
            f"{alpha_text:.3f}), c {c:.3f}, expected speedup "
            f"(k=4) {speedup:.2f}x",
            flush=True,
        )
    (work / "students.json").write_text(json.dumps(results, indent=1))
    best = max(results, key=lambda r: float(r["expected_speedup_k4"]))  # type: ignore[arg-type]
    if config.out.exists():
        shutil.rmtree(config.out)
    shutil.copytree(work / f"student-{best['shape']}", config.out)
    print(f"chose {best['describe']}; wrote {config.out}", flush=True)
    return config.out


@dataclass
class Split(Generic[T]):
    train: list[T]
    held_out: list[T]


def split_corpus(examples: list[T], num_answers: int) -> tuple[Split[T], Split[T]]:
    """Answers and plain text, each with every ``HELD_OUT_EVERY``-th sequence held out (at
    least one of a part of two or more)."""

    def split(part: list[T]) -> Split[T]:
        every = min(HELD_OUT_EVERY, max(2, len(part)))
        held = [e for i, e in enumerate(part) if i % every == every - 1]
        kept = [e for i, e in enumerate(part) if i % every != every - 1]
        return Split(kept, held)

    return split(examples[:num_answers]), split(examples[num_answers:])


def mix(answers: list[Example], text: list[Example], text_share: float) -> list[Example]:
    """All answers plus an evenly spaced subset of the text holding at most ``text_share`` of
    the tokens: the drafter serves chat, so the target's answers dominate what it learns."""
    if not text or text_share <= 0:
        return list(answers)
    budget = text_share / max(1e-9, 1 - text_share) * _tokens(answers) if answers else math.inf
    order = list(range(len(text)))
    random.Random(0).shuffle(order)
    chosen, used = set(), 0
    for i in order:  # a fixed random subset, filled up to the budget
        if used + len(text[i][0]) <= budget:
            chosen.add(i)
            used += len(text[i][0])
    return list(answers) + [e for i, e in enumerate(text) if i in chosen]


def _tokens(examples: list[Example]) -> int:
    return sum(len(e[0]) for e in examples)


def _vocabulary(config: DistillConfig, sequences: list[list[int]]) -> list[int]:
    path = config.work / "vocab.json"
    if path.exists():
        return list(json.loads(path.read_text()))
    tokenizer = load_tokenizer(resolve_model_path(config.target))
    always = set(tokenizer.all_special_ids) | set(tokenizer.eos_token_ids)
    token_map = select_vocabulary(sequences, config.vocab_size, always)
    path.write_text(json.dumps(token_map))
    return token_map


def greedy_agreement(
    student: LlamaForCausalLM, examples: list[Example], prompt_lens: list[int] | None = None
) -> float:
    """How often the student's argmax is the teacher's argmax over the held-out sequences:
    at the positions that predict answer tokens where ``prompt_lens`` are given (0: the whole
    sequence), at every position otherwise."""
    agree = total = 0
    with torch.no_grad():
        for i, (ids, top_ids, top_p) in enumerate(examples):
            first = max(0, prompt_lens[i] - 1) if prompt_lens else 0
            logits = run_dense(student, [ids.tolist()])[0, first:, :-1]
            scored = top_p[first:, 0] > 0  # the last position of a stored-label row has none
            hits = logits.argmax(-1) == top_ids[first:, 0].long()
            agree += int((hits & scored).sum())
            total += int(scored.sum())
    return agree / max(total, 1)


def expected_speedup(alpha: float, c: float, k: int) -> float:
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def load_and_pack(path: str | None) -> LlamaForCausalLM:
    model = load_model(resolve_model_path(path))
    model.pack_for_cpu()
    return model


def decode_ms(model: LlamaForCausalLM, context: int = 256, repeats: int = 30) -> float:
    """Median time of one single-token decode step at ``context`` tokens, batch 1."""
    block_size = 16
    blocks = context // block_size + 1
    model.bind_kv_caches(
        allocate_kv_caches(model.config, blocks, block_size, model.dtype, model.device)
    )
    runner = ModelRunner(model, block_size)
    batch = flatten([TokenRun([1], context - 1, list(range(blocks)))], block_size)
    rows = batch.query_start[1:] - 1
    return median_ms(lambda: runner.forward(batch, rows), model.device, repeats)


def median_ms(step: Callable[[], object], device: torch.device, repeats: int = 30) -> float:
    """Median wall time of ``step`` in milliseconds, after 5 warm-up calls."""
    for _ in range(5):
        step()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        step()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
