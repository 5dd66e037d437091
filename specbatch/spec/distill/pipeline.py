"""``specbatch distill-draft``: corpus, soft labels, students of several sizes, pick the best.

Every stage writes its result into the work directory and is skipped when that result exists,
so the whole command can be interrupted and run again. For each student shape it reports alpha
(greedy agreement with the target on held-out positions, i.e. the per-token greedy acceptance
rate given a correct prefix) and c (one draft decode step over one target decode step, measured
here), and keeps the shape with the best expected speedup
``(1 - a^(k+1)) / ((1 - a) (k c + 1))`` (Leviathan et al.) at ``k = 4``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specbatch.cache.kv_tensors import allocate_kv_caches
from specbatch.engine.flat_batch import TokenRun, flatten
from specbatch.engine.model_runner import ModelRunner
from specbatch.models import load_model, resolve_model_path
from specbatch.models.llama import LlamaForCausalLM
from specbatch.spec.distill.corpus import generate_answers, load_sequences, tokenize_text
from specbatch.spec.distill.student import (
    StudentShape,
    build_student,
    save_student,
    select_vocabulary,
    student_config,
)
from specbatch.spec.distill.teacher import load_shards, run_dense, score_corpus
from specbatch.spec.distill.train import Example, train
from specbatch.tokenizer import load_tokenizer


@dataclass
class DistillConfig:
    """Everything ``specbatch distill-draft`` takes (see its ``--help``)."""

    work: Path
    out: Path
    target: str | None = None
    shapes: list[StudentShape] = field(default_factory=lambda: [StudentShape()])
    num_prompts: int = 2000
    answer_tokens: int = 192
    text_chars: int = 1_500_000
    vocab_size: int = 8192
    top_k: int = 16
    max_len: int = 512
    steps: int = 3000
    tokens_per_batch: int = 4096
    lr: float = 2e-3
    seed: int = 0
    generation_batch: int = 32


def parse_shape(text: str) -> StudentShape:
    """``LAYERSxHIDDEN`` (e.g. ``4x256``): heads of 64, half as many KV heads, MLP 3x."""
    layers, hidden = (int(x) for x in text.lower().split("x"))
    heads = max(1, hidden // 64)
    return StudentShape(hidden, layers, heads, max(1, heads // 2), 3 * hidden)


def run(config: DistillConfig) -> Path:
    work = config.work
    work.mkdir(parents=True, exist_ok=True)
    generate_answers(
        config.target,
        work,
        config.num_prompts,
        config.answer_tokens,
        config.generation_batch,
        config.seed,
    )
    tokenize_text(config.target, work, config.text_chars)
    sequences = load_sequences(work, config.max_len)
    token_map = _vocabulary(config, sequences)
    teacher = load_model(config.target, attention_backend="dense_causal")
    teacher.pack_for_cpu()
    shards = score_corpus(teacher, sequences, token_map, work, config.top_k, max_tokens=2048)
    examples = load_shards(shards)
    held_out = max(8, len(examples) // 30)
    train_set, valid_set = examples[:-held_out], examples[-held_out:]
    print(
        f"corpus: {len(examples)} sequences, {sum(len(e[0]) for e in examples)} tokens; "
        f"draft vocabulary {len(token_map)}",
        flush=True,
    )
    target_ms = decode_ms(load_and_pack(config.target))
    results = []
    for shape in config.shapes:
        name = f"{shape.num_layers}x{shape.hidden_size}"
        student = build_student(
            student_config(teacher.config, shape, token_map),
            teacher.model.embed_tokens.weight,
            config.seed,
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
        alpha = greedy_agreement(student, valid_set)
        directory = work / f"student-{name}"
        digest = save_student(student, directory, {"shape": shape.describe()})
        c = decode_ms(load_and_pack(str(directory))) / target_ms
        speedup = expected_speedup(alpha, c, k=4)
        results.append(
            {
                "shape": name,
                "describe": shape.describe(),
                "alpha": alpha,
                "c": c,
                "expected_speedup_k4": speedup,
                "sha256": digest,
            }
        )
        print(
            f"student {shape.describe()}: alpha {alpha:.3f}, c {c:.3f}, expected speedup "
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


def _vocabulary(config: DistillConfig, sequences: list[list[int]]) -> list[int]:
    path = config.work / "vocab.json"
    if path.exists():
        return list(json.loads(path.read_text()))
    tokenizer = load_tokenizer(resolve_model_path(config.target))
    always = set(tokenizer.all_special_ids) | set(tokenizer.eos_token_ids)
    token_map = select_vocabulary(sequences, config.vocab_size, always)
    path.write_text(json.dumps(token_map))
    return token_map


def greedy_agreement(student: LlamaForCausalLM, examples: list[Example]) -> float:
    """How often the student's argmax is the teacher's argmax (held-out positions)."""
    agree = total = 0
    with torch.no_grad():
        for ids, top_ids, _ in examples:
            logits = run_dense(student, [ids.tolist()])[0, :, :-1]
            agree += int((logits.argmax(-1) == top_ids[:, 0].long()).sum())
            total += len(ids)
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
    runner = ModelRunner(model)
    batch = flatten([TokenRun([1], context - 1, list(range(blocks)))], block_size)
    rows = batch.query_start[1:] - 1
    for _ in range(5):
        runner.forward(batch, rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(batch, rows)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)
